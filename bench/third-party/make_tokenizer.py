#!/usr/bin/env python3
"""A small byte-level BPE tokenizer, trained here with the `tokenizers`
package on generated English-like text and saved as a Hugging Face
tokenizer directory (tokenizer.json + tokenizer_config.json), for load
generators that need one to build synthetic prompts (bench/loadgen.py).
Nothing is downloaded. Deterministic: the same text, the same vocabulary.

    python make_tokenizer.py OUT_DIR
"""

import random
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

WORDS = ("the of and to in is that for it as was with be by on not he this are or his "
         "from at which but have an they you were her she there been one all we their "
         "request token budget model stream server answer latency window limit tier "
         "policy caller usage reserve settle envoy filter proxy upstream client time "
         "first second inter byte count price daily monthly hard soft queue batch").split()


def corpus(n, seed=27):
    rng = random.Random(seed)
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(8, 40))]
        yield " ".join(words).capitalize() + rng.choice(".?!") + " " + str(rng.randint(0, 9999))


def main(out):
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(5000), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)


if __name__ == "__main__":
    main(sys.argv[1])

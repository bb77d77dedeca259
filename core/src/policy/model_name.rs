//! A model name as Ollama resolves it, so that every spelling of one model
//! is one model to the policy.
//!
//! Ollama's rules, copied from its source (ollama/ollama, August 2026):
//! - `internal/modelref/modelref.go` `ParseRef`: the name is trimmed of
//!   white space; a last `:cloud` or `:local` part (any case), or a tag
//!   ending in `-cloud`, says where the model runs and is not part of it.
//! - `types/model/name.go` `ParseNameBare`: `[host/][namespace/]model[:tag]`,
//!   cut from the right (a `:` before the last `/` is a host's port; a
//!   `scheme://` before the host is not part of the name); a separator
//!   with nothing on one side makes the name invalid (`MissingPart`).
//!   `ParseName` fills what is absent from `DefaultName`:
//!   `registry.ollama.ai`, `library`, `latest`. `IsValid`: every part
//!   starts with a letter, digit or `_` and holds only those, `-` and
//!   `.` (no `.` in a namespace; `:` only in a host), 1 to 80 bytes (a
//!   host up to 350).
//! - `Name.EqualFold` and `server/routes.go` `getExistingName`: parts
//!   compare without case (`/api/chat`, `/api/generate` and `/api/embed`
//!   look the model up through them, `server/model_resolver.go`
//!   `parseAndValidateModelRef`). A valid name is ASCII, so ASCII case
//!   folding is Go's `strings.EqualFold` here.
//!
//! A name Ollama would refuse has no [`OllamaName`]: such a name matches a
//! policy's model only as written.

/// Ollama's defaults for the parts a name leaves out (`DefaultName`).
const DEFAULT_HOST: &str = "registry.ollama.ai";
const DEFAULT_NAMESPACE: &str = "library";
const DEFAULT_TAG: &str = "latest";

/// A model name resolved by Ollama's rules: every part present, lower
/// case. Two spellings are one model exactly when their names are equal.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct OllamaName {
    pub host: String,
    pub namespace: String,
    pub model: String,
    pub tag: String,
    /// `:cloud` (or a `-cloud` tag): the model runs on Ollama's cloud,
    /// not the local server — another model to the policy.
    pub cloud: bool,
}

/// The kinds of part, for their character rules.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Part {
    Host,
    Namespace,
    Model,
    Tag,
}

impl OllamaName {
    /// The name as Ollama resolves `written`, or `None` where Ollama would
    /// refuse it.
    pub fn parse(written: &str) -> Option<OllamaName> {
        let (base, cloud) = source_suffix(written.trim())?;
        let name = bare(&base)?;
        let host = name.host.unwrap_or(DEFAULT_HOST);
        let namespace = name.namespace.unwrap_or(DEFAULT_NAMESPACE);
        let tag = name.tag.unwrap_or(DEFAULT_TAG);
        let parts = [
            (Part::Host, host),
            (Part::Namespace, namespace),
            (Part::Model, name.model),
            (Part::Tag, tag),
        ];
        if !parts.iter().all(|(kind, text)| valid(*kind, text)) {
            return None;
        }
        Some(OllamaName {
            host: host.to_ascii_lowercase(),
            namespace: namespace.to_ascii_lowercase(),
            model: name.model.to_ascii_lowercase(),
            tag: tag.to_ascii_lowercase(),
            cloud,
        })
    }

    /// The shortest spelling Ollama reads as this name (its
    /// `DisplayShortest`: the default host and namespace left out), with
    /// `:cloud` for a cloud model.
    pub fn shortest(&self) -> String {
        let mut s = String::new();
        if self.host != DEFAULT_HOST {
            s.push_str(&self.host);
            s.push('/');
            s.push_str(&self.namespace);
            s.push('/');
        } else if self.namespace != DEFAULT_NAMESPACE {
            s.push_str(&self.namespace);
            s.push('/');
        }
        s.push_str(&self.model);
        s.push(':');
        s.push_str(&self.tag);
        if self.cloud {
            s.push_str(":cloud");
        }
        s
    }
}

/// `ParseRef`'s source suffix: (the name without it, runs in the cloud).
/// `None`: both suffixes (`x:local:cloud`), which Ollama refuses.
fn source_suffix(raw: &str) -> Option<(String, bool)> {
    fn cut(raw: &str) -> Option<(String, bool)> {
        let i = raw.rfind(':')?;
        let suffix_raw = raw[i + 1..].trim();
        let suffix = suffix_raw.to_ascii_lowercase();
        match suffix.as_str() {
            "cloud" => Some((raw[..i].to_string(), true)),
            "local" => Some((raw[..i].to_string(), false)),
            // A `-cloud` tag: the tag without it (`raw[:idx+1] +
            // suffixRaw[:len(suffixRaw)-len("-cloud")]`).
            s if !suffix_raw.contains('/') && s.ends_with("-cloud") => {
                let tag = &suffix_raw[..suffix_raw.len() - "-cloud".len()];
                Some((format!("{}{tag}", &raw[..=i]), true))
            }
            _ => None,
        }
    }
    match cut(raw) {
        None => Some((raw.to_string(), false)),
        Some((base, cloud)) => match cut(&base) {
            Some(_) => None,
            None => Some((base, cloud)),
        },
    }
}

/// The parts a name writes (`None`: left out, filled by the default;
/// `Some("")`: a separator with nothing beside it, which is invalid).
struct Bare<'a> {
    host: Option<&'a str>,
    namespace: Option<&'a str>,
    model: &'a str,
    tag: Option<&'a str>,
}

/// `ParseNameBare`: cut from the right at the last `:` (if after the last
/// `/`), then at `/` twice; what is left is the host, less a `scheme://`.
fn bare(s: &str) -> Option<Bare<'_>> {
    let mut s = s;
    let mut tag = None;
    // `None` is below every index, as Go's -1 is.
    if s.rfind(':') > s.rfind('/') {
        let (before, after) = s.rsplit_once(':')?;
        tag = Some(after);
        s = before;
    }
    let Some((rest, model)) = s.rsplit_once('/') else {
        return Some(Bare {
            host: None,
            namespace: None,
            model: s,
            tag,
        });
    };
    let Some((host, namespace)) = rest.rsplit_once('/') else {
        return Some(Bare {
            host: None,
            namespace: Some(rest),
            model,
            tag,
        });
    };
    let host = host.split_once("://").map_or(host, |(_, h)| h);
    Some(Bare {
        host: Some(host),
        namespace: Some(namespace),
        model,
        tag,
    })
}

/// `isValidPart`: the characters and length Ollama accepts in a part.
fn valid(kind: Part, s: &str) -> bool {
    let max = if kind == Part::Host { 350 } else { 80 };
    let bytes = s.as_bytes();
    let Some(first) = bytes.first() else {
        return false;
    };
    bytes.len() <= max
        && (first.is_ascii_alphanumeric() || *first == b'_')
        && bytes[1..].iter().all(|&b| match b {
            b'_' | b'-' => true,
            b'.' => kind != Part::Namespace,
            b':' => kind == Part::Host,
            b => b.is_ascii_alphanumeric(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn canonical(s: &str) -> Option<String> {
        OllamaName::parse(s).map(|n| {
            format!(
                "{}/{}/{}:{}{}",
                n.host,
                n.namespace,
                n.model,
                n.tag,
                if n.cloud { " cloud" } else { "" }
            )
        })
    }

    #[test]
    fn the_spellings_of_the_issue_are_one_model() {
        let want = Some("registry.ollama.ai/library/llama3.1:70b".to_string());
        for s in [
            "llama3.1:70b",
            "LLAMA3.1:70B",
            "library/llama3.1:70b",
            "registry.ollama.ai/library/llama3.1:70b",
            "Registry.Ollama.AI/Library/Llama3.1:70b",
            "https://registry.ollama.ai/library/llama3.1:70b",
            "  llama3.1:70b\t",
            "llama3.1:70b:local",
            "llama3.1:70b:LOCAL",
        ] {
            assert_eq!(canonical(s), want, "{s}");
        }
        assert_eq!(
            canonical("llama3"),
            Some("registry.ollama.ai/library/llama3:latest".into())
        );
        assert_eq!(
            OllamaName::parse("LLAMA3").map(|n| n.shortest()),
            Some("llama3:latest".into())
        );
    }

    #[test]
    fn other_hosts_namespaces_tags_and_the_cloud_are_other_models() {
        let base = canonical("llama3.1:70b");
        for s in [
            "llama3.1:8b",
            "llama3.1",
            "me/llama3.1:70b",
            "example.com/library/llama3.1:70b",
            "registry.ollama.ai:443/library/llama3.1:70b",
            "llama3.1:70b:cloud",
            "llama3.1:70b-cloud",
        ] {
            assert_ne!(canonical(s), base, "{s}");
        }
        // `:cloud` and a `-cloud` tag are one cloud model.
        assert_eq!(
            canonical("gpt-oss:20b:cloud"),
            canonical("gpt-oss:20b-cloud")
        );
        assert_eq!(
            canonical("example.com:5000/me/m"),
            Some("example.com:5000/me/m:latest".into())
        );
    }

    #[test]
    fn names_ollama_refuses_have_no_ollama_name() {
        for s in [
            "",
            "   ",
            ":70b",
            "llama3:",
            "/llama3",
            "a//b",
            "a/b/c/d",
            "my.ns/model",
            "-model",
            "mo del",
            "model@sha256:abc",
            "m:local:cloud",
            "Ｌlama3",
            &"m".repeat(81),
        ] {
            assert_eq!(canonical(s), None, "{s:?}");
        }
        assert!(canonical(&"m".repeat(80)).is_some());
    }

    /// One way to write a part of a name in another case, chosen by `flips`.
    fn recase(s: &str, flips: u64) -> String {
        s.chars()
            .enumerate()
            .map(|(i, c)| {
                if flips >> (i % 64) & 1 == 1 {
                    c.to_ascii_uppercase()
                } else {
                    c
                }
            })
            .collect()
    }

    proptest! {
        /// Every spelling Ollama reads as one name (case, the defaults
        /// written or left out, a scheme, `:local`, white space around it)
        /// resolves to that name; another tag never does.
        #[test]
        fn every_spelling_of_a_name_resolves_to_it(
            model in "[a-z0-9_][a-z0-9_.-]{0,20}",
            tag in proptest::option::of("[a-z0-9_][a-z0-9_.-]{0,10}"),
            flips in any::<u64>(),
            form in 0u8..8,
        ) {
            prop_assume!(!tag.as_deref().is_some_and(|t| t.ends_with("-cloud")));
            prop_assume!(!matches!(tag.as_deref(), Some("cloud" | "local")));
            let tagged = |m: &str| match &tag {
                Some(t) => format!("{m}:{t}"),
                None => m.to_string(),
            };
            let want = OllamaName::parse(&tagged(&model));
            prop_assert!(want.is_some());
            let written = recase(&tagged(&model), flips);
            let spelled = match form {
                0 => written,
                1 => format!("library/{written}"),
                2 => format!("registry.ollama.ai/library/{written}"),
                3 => format!("REGISTRY.ollama.ai/Library/{written}"),
                4 => format!("https://registry.ollama.ai/library/{written}"),
                5 => format!(" {written} "),
                6 => format!("{}:local", tagged(&recase(&model, flips))),
                _ => match &tag {
                    None => format!("{written}:latest"),
                    Some(_) => written,
                },
            };
            prop_assert_eq!(OllamaName::parse(&spelled), want.clone(), "{}", spelled);
            let other = format!("{model}:{}x", tag.as_deref().unwrap_or("latest"));
            prop_assert_ne!(OllamaName::parse(&other), want);
        }
    }
}

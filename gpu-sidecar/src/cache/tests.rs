//! The cache's store, semantic rule and endpoints (memory and Redis).

use std::sync::Arc;
use std::time::Duration;

use sluice_wire::cache::{Entry, Kind, LookupRequest, Semantic, StoreRequest};

use super::semantic::EmbeddingsConfig;
use super::*;

pub(crate) fn hash(s: &str) -> String {
    use std::fmt::Write as _;
    // Any 64 hex digits will do: the filter's hashes are opaque here.
    let mut out = String::new();
    let mut h: u64 = 0xcbf29ce484222325;
    for b in s.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x100000001b3);
    }
    for i in 0..4u64 {
        let _ = write!(
            out,
            "{:016x}",
            h.wrapping_mul(i + 1).rotate_left(i as u32 * 7)
        );
    }
    out
}

fn entry(body: &str, tokens: u64) -> Entry {
    Entry {
        body: body.into(),
        prompt_tokens: tokens,
        completion_tokens: tokens,
        spend_micros: 5,
    }
}

pub(crate) fn store_req(key: &str, body: &str, semantic: Option<(&str, &str)>) -> StoreRequest {
    StoreRequest {
        key: hash(key),
        model: "m".into(),
        ttl_s: 60,
        semantic: semantic.map(|(c, t)| Semantic {
            context: hash(c),
            text: t.into(),
        }),
        entry: entry(body, 3),
        scope: None,
        generation: None,
    }
}

pub(crate) fn lookup_req(key: &str, semantic: Option<(&str, &str)>) -> LookupRequest {
    LookupRequest {
        key: hash(key),
        model: "m".into(),
        semantic: semantic.map(|(c, t)| Semantic {
            context: hash(c),
            text: t.into(),
        }),
        exact: true,
        threshold: None,
        top_k: None,
    }
}

pub(crate) fn memory_cache(embeddings: Option<String>) -> Arc<Cache> {
    Cache::new(
        CacheConfig {
            embeddings: embeddings.map(|url| EmbeddingsConfig {
                url,
                model: "embed".into(),
                timeout: Duration::from_secs(5),
                api_key_env: None,
            }),
            ..CacheConfig::default()
        },
        None,
    )
    .unwrap()
}

async fn mock_llm() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = mock_llm::app(mock_llm::Config::default()).unwrap();
    tokio::spawn(mock_llm::serve(listener, app, std::future::pending()));
    format!("http://{addr}/v1/embeddings")
}

fn body_of(a: &sluice_wire::cache::LookupAnswer) -> Option<&str> {
    a.hit.as_ref().map(|h| h.entry.body.as_str())
}

#[tokio::test]
async fn exact_hit_miss_and_age() {
    let c = memory_cache(None);
    assert!(c
        .lookup(&lookup_req("k", None), 1000)
        .await
        .unwrap()
        .hit
        .is_none());
    assert!(
        c.store(store_req("k", "answer", None), 1000)
            .await
            .unwrap()
            .stored
    );
    let a = c.lookup(&lookup_req("k", None), 4500).await.unwrap();
    let hit = a.hit.unwrap();
    assert_eq!(
        (hit.kind, hit.age_s, hit.entry.body.as_str()),
        (Kind::Exact, 3, "answer")
    );
    // Expired (ttl 60 s): a miss.
    assert!(c
        .lookup(&lookup_req("k", None), 61_001)
        .await
        .unwrap()
        .hit
        .is_none());
    assert_eq!(c.stats.get("m", Kind::Exact, "hit"), 1);
    assert_eq!(c.stats.get("m", Kind::Exact, "miss"), 2);
    assert_eq!(c.stats.get("m", Kind::Exact, "store"), 1);
}

#[tokio::test]
async fn bad_requests_are_refused() {
    let c = memory_cache(None);
    let mut r = lookup_req("k", None);
    r.key = "not-a-hash".into();
    assert!(c.lookup(&r, 0).await.is_err());
    let mut s = store_req("k", "a", None);
    s.model = "m".repeat(300);
    assert!(c.store(s, 0).await.is_err());
    let mut s = store_req("k", "a", Some(("c", "t")));
    s.semantic.as_mut().unwrap().context = "zz".into();
    assert!(c.store(s, 0).await.is_err());
    let mut s = store_req("k", "a", None);
    s.ttl_s = 0;
    assert!(c.store(s, 0).await.is_err());
}

#[tokio::test]
async fn too_large_and_ttl_capped() {
    let c = Cache::new(
        CacheConfig {
            max_entry_bytes: 10,
            max_ttl: Duration::from_secs(5),
            ..CacheConfig::default()
        },
        None,
    )
    .unwrap();
    let a = c
        .store(store_req("k", &"x".repeat(11), None), 0)
        .await
        .unwrap();
    assert_eq!(a.reason, Some(sluice_wire::cache::NotStored::TooLarge));
    let mut s = store_req("k", "small", None);
    s.ttl_s = 86_400;
    assert!(c.store(s, 0).await.unwrap().stored);
    assert!(c
        .lookup(&lookup_req("k", None), 4_999)
        .await
        .unwrap()
        .hit
        .is_some());
    assert!(c
        .lookup(&lookup_req("k", None), 5_000)
        .await
        .unwrap()
        .hit
        .is_none());
}

/// The heap a thread holds, for [`memory_bound_under_ten_times_max_bytes`]:
/// a global allocator for this test binary that forwards every call to the
/// system allocator unchanged and keeps, per thread, the bytes allocated
/// less the bytes freed.
mod heap {
    use std::alloc::{GlobalAlloc, Layout, System};
    use std::cell::Cell;

    struct Counting;

    thread_local! {
        static HELD: Cell<i64> = const { Cell::new(0) };
    }

    fn add(bytes: usize, sign: i64) {
        let bytes = i64::try_from(bytes).unwrap_or(i64::MAX);
        // In a thread's teardown the counter may be gone: not counted.
        let _ = HELD.try_with(|h| h.set(h.get().saturating_add(sign * bytes)));
    }

    // SAFETY: every call is forwarded to the system allocator unchanged;
    // the counter is a thread-local `Cell` (no allocation, no lock).
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            // SAFETY: forwarded as is.
            let p = unsafe { System.alloc(layout) };
            if !p.is_null() {
                add(layout.size(), 1);
            }
            p
        }

        unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
            // SAFETY: forwarded as is.
            let p = unsafe { System.alloc_zeroed(layout) };
            if !p.is_null() {
                add(layout.size(), 1);
            }
            p
        }

        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            // SAFETY: forwarded as is.
            unsafe { System.dealloc(ptr, layout) };
            add(layout.size(), -1);
        }

        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            // SAFETY: forwarded as is.
            let p = unsafe { System.realloc(ptr, layout, new_size) };
            if !p.is_null() {
                add(layout.size(), -1);
                add(new_size, 1);
            }
            p
        }
    }

    #[global_allocator]
    static GLOBAL: Counting = Counting;

    /// Bytes this thread allocated and has not freed (less what it freed
    /// of other threads' allocations).
    pub fn held() -> i64 {
        HELD.with(Cell::get)
    }
}

/// The memory store's real heap stays under ten times `max_bytes` however
/// much is stored: measured with the counting allocator ([`heap`]) as the
/// bytes this thread holds from just after the cache is made to just after
/// 5,000 stores of 1,000-byte answers (about 6.6 MB of entries by the
/// store's own count). `#[tokio::test]` runs the cache on this one thread
/// (a current-thread runtime; nothing here spawns a thread), so all the
/// cache keeps was allocated here, and the test keeps nothing else: the
/// figure is the cache's live heap, deterministic, untouched by tests
/// running beside it (unlike the process's RSS). It is what the cache asks
/// of the allocator: the allocator's own cost per block (malloc's header,
/// its size classes) is not in it, which the margin of ten covers (the
/// store's accounting already charges 256 bytes per entry beyond what it
/// holds). A store that forgot what it evicted, or kept a second copy of
/// each entry elsewhere, would hold megabytes against a bound of 1 MB.
#[tokio::test]
async fn memory_bound_under_ten_times_max_bytes() {
    const MAX_BYTES: u64 = 100_000;
    const STORES: u64 = 5_000;
    let c = Cache::new(
        CacheConfig {
            max_bytes: MAX_BYTES,
            max_entry_bytes: 2_000,
            ..CacheConfig::default()
        },
        None,
    )
    .unwrap();
    let body = "y".repeat(1_000);
    let before = heap::held();
    for i in 0..STORES {
        c.store(store_req(&format!("k{i}"), &body, None), 0)
            .await
            .unwrap();
        // The store's own accounting (what eviction goes by) never passes
        // the bound itself.
        let (_, bytes) = c.size().await;
        assert!(bytes <= MAX_BYTES, "{bytes}");
    }
    let held = heap::held() - before;
    let (entries, _) = c.size().await;
    let entries = i64::try_from(entries).unwrap();
    println!("{entries} entries: {held} bytes of heap, bound {MAX_BYTES}");
    // The measure sees the cache: at least the bodies it holds.
    assert!(
        entries > 0 && held >= entries * 1_000,
        "{entries} entries, {held} bytes"
    );
    assert!(
        held <= 10 * i64::try_from(MAX_BYTES).unwrap(),
        "the cache holds {held} bytes of heap for max_bytes {MAX_BYTES}"
    );
    assert!(c.stats.get("m", Kind::Exact, "evict") > STORES - 100);
    // The newest are there, the oldest gone.
    assert!(c
        .lookup(&lookup_req(&format!("k{}", STORES - 1), None), 0)
        .await
        .unwrap()
        .hit
        .is_some());
    assert!(c
        .lookup(&lookup_req("k0", None), 0)
        .await
        .unwrap()
        .hit
        .is_none());
}

#[tokio::test]
async fn semantic_paraphrase_hits_only_in_its_context() {
    let c = memory_cache(Some(mock_llm().await));
    let q = "How do I enable 2FA on my account?";
    assert!(
        c.store(
            store_req("k1", "turn it on in settings", Some(("conv-a", q))),
            0
        )
        .await
        .unwrap()
        .stored
    );
    // A paraphrase (case and punctuation) in the same context: a hit.
    let a = c
        .lookup(
            &lookup_req("k2", Some(("conv-a", "how do I enable 2fa on my account"))),
            0,
        )
        .await
        .unwrap();
    let hit = a.hit.unwrap();
    assert_eq!(hit.kind, Kind::Semantic);
    assert_eq!(hit.entry.body, "turn it on in settings");
    assert!(hit.similarity.unwrap() >= 0.95);
    // The same question in another conversation (or scope: the filter
    // hashes the scope into the context): a miss.
    let other = c
        .lookup(&lookup_req("k3", Some(("conv-b", q))), 0)
        .await
        .unwrap();
    assert!(other.hit.is_none());
    // The near miss the threshold must separate.
    let opposite = c
        .lookup(
            &lookup_req(
                "k4",
                Some(("conv-a", "How do I disable 2FA on my account?")),
            ),
            0,
        )
        .await
        .unwrap();
    assert!(body_of(&opposite).is_none());
    // A lower threshold asked for is raised to the sidecar's
    // `min_threshold` (0.9): the near miss (0.87) still misses.
    let mut loose = lookup_req(
        "k4",
        Some(("conv-a", "How do I disable 2FA on my account?")),
    );
    loose.threshold = Some(0.8);
    assert!(c.lookup(&loose, 0).await.unwrap().hit.is_none());
    assert_eq!(c.stats.get("m", Kind::Semantic, "hit"), 1);
    // Expired: the vector no longer answers.
    assert!(c
        .lookup(&lookup_req("k2", Some(("conv-a", q))), 61_000)
        .await
        .unwrap()
        .hit
        .is_none());
}

#[tokio::test]
async fn embeddings_down_is_a_miss() {
    let c = memory_cache(Some("http://127.0.0.1:1/v1/embeddings".into()));
    let a = c
        .store(store_req("k1", "answer", Some(("c", "q"))), 0)
        .await
        .unwrap();
    assert!(a.stored, "the exact entry is kept");
    assert!(c
        .lookup(&lookup_req("k2", Some(("c", "q"))), 0)
        .await
        .unwrap()
        .hit
        .is_none());
    assert!(c
        .lookup(&lookup_req("k1", None), 0)
        .await
        .unwrap()
        .hit
        .is_some());
    assert!(
        c.stats
            .embedding_failures
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 1
    );
}

#[tokio::test]
async fn evicted_entries_leave_the_index() {
    let url = mock_llm().await;
    let c = Cache::new(
        CacheConfig {
            max_entries: 2,
            embeddings: Some(EmbeddingsConfig {
                url,
                model: "e".into(),
                timeout: Duration::from_secs(5),
                api_key_env: None,
            }),
            ..CacheConfig::default()
        },
        None,
    )
    .unwrap();
    for i in 0..5 {
        c.store(
            store_req(&format!("k{i}"), "a", Some(("c", &format!("question {i}")))),
            0,
        )
        .await
        .unwrap();
    }
    assert_eq!(c.vectors(), 2);
}

#[tokio::test]
async fn expired_entries_and_vectors_are_swept() {
    let url = mock_llm().await;
    let c = bounded_cache(10_000, 64 << 20, Some(url));
    // One semantic entry with a short TTL, never looked up again.
    let mut short = store_req("short", "a", Some(("c", "how do I enable 2FA")));
    short.ttl_s = 1;
    assert!(c.store(short, 0).await.unwrap().stored);
    assert_eq!((c.vectors(), c.size().await.0), (1, 1));
    // Long-lived stores after its expiry: the sweep takes it out.
    for i in 0..SWEEP_EVERY {
        let req = store_req(&format!("long{i}"), "b", None);
        assert!(c.store(req, 5_000).await.unwrap().stored);
    }
    assert_eq!(c.vectors(), 0);
    assert_eq!(c.size().await.0, SWEEP_EVERY);
}

#[tokio::test]
async fn purge_by_model() {
    let c = memory_cache(None);
    c.store(store_req("a", "1", None), 0).await.unwrap();
    let mut other = store_req("b", "2", None);
    other.model = "m2".into();
    c.store(other, 0).await.unwrap();
    assert_eq!(c.purge(Some("m2")).await.unwrap(), 1);
    assert_eq!(c.size().await.0, 1);
    assert_eq!(c.purge(None).await.unwrap(), 1);
    assert_eq!(c.size().await.0, 0);
}

fn bounded_cache(max_entries: usize, max_bytes: u64, embeddings: Option<String>) -> Arc<Cache> {
    Cache::new(
        CacheConfig {
            max_entries,
            max_bytes,
            max_entry_bytes: max_bytes.min(1 << 20),
            embeddings: embeddings.map(|url| EmbeddingsConfig {
                url,
                model: "embed".into(),
                timeout: Duration::from_secs(5),
                api_key_env: None,
            }),
            ..CacheConfig::default()
        },
        None,
    )
    .unwrap()
}

/// Stores `n` answers of `body_len` bytes for `scope` (keys `{scope}/{i}`);
/// how many were kept.
async fn fill(c: &Cache, scope: &str, n: usize, body_len: usize, now: u64) -> usize {
    let id = scope_id(scope);
    let mut kept = 0;
    for i in 0..n {
        let mut req = store_req(&format!("{scope}/{i}"), &"x".repeat(body_len), None);
        req.scope = Some(id.clone());
        let a = c.store(req, now).await.unwrap();
        assert!(a.stored || a.reason == Some(NotStored::Full), "{a:?}");
        kept += usize::from(a.stored);
    }
    kept
}

async fn held(c: &Cache, scope: &str, n: usize, now: u64) -> usize {
    let mut held = 0;
    for i in 0..n {
        let req = lookup_req(&format!("{scope}/{i}"), None);
        held += usize::from(c.lookup(&req, now).await.unwrap().hit.is_some());
    }
    held
}

#[tokio::test]
async fn one_scope_flooding_evicts_only_its_own() {
    // 100 entries: four callers hold 10 each, then one stores 1,000.
    let c = bounded_cache(100, 64 << 20, None);
    for who in ["team:a", "team:b", "team:c", "team:d"] {
        fill(&c, who, 10, 10, 0).await;
    }
    fill(&c, "principal:ip:10.9.9.9", 1000, 10, 0).await;
    for who in ["team:a", "team:b", "team:c", "team:d"] {
        assert_eq!(held(&c, who, 10, 1).await, 10, "{who} kept all");
    }
    // The flood holds the rest, its newest.
    assert_eq!(c.size().await.0, 100);
    assert_eq!(held(&c, "principal:ip:10.9.9.9", 1000, 1).await, 60);
    let flood = "principal:ip:10.9.9.9";
    assert!(c
        .lookup(&lookup_req(&format!("{flood}/999"), None), 1)
        .await
        .unwrap()
        .hit
        .is_some());
    assert_eq!(c.stats.get("m", Kind::Exact, "evict"), 940);
    // A store without a scope id shares the scope "" (bounded the same way).
    assert!(
        c.store(store_req("plain", "p", None), 1)
            .await
            .unwrap()
            .stored
    );
    assert_eq!(held(&c, "team:a", 10, 1).await, 10);
}

#[tokio::test]
async fn many_scopes_cut_only_those_over_the_floor() {
    // 100 entries, floor 4: one caller holds 40, then 30 scopes store 5
    // each. The large one gives way down to the floor, each newcomer keeps
    // its newest 4; once every scope is within its floor (25 × 4), the
    // scopes still coming store nothing (`full`) and evict nobody.
    let c = bounded_cache(100, 64 << 20, None);
    assert_eq!(fill(&c, "team:big", 40, 10, 0).await, 40);
    let mut kept = Vec::new();
    for i in 0..30 {
        kept.push(fill(&c, &format!("principal:ip:10.0.0.{i}"), 5, 10, 0).await);
    }
    let big = held(&c, "team:big", 40, 1).await;
    let mut small = Vec::new();
    for i in 0..30 {
        small.push(held(&c, &format!("principal:ip:10.0.0.{i}"), 5, 1).await);
    }
    assert_eq!(c.size().await.0, 100);
    assert_eq!(big, 4, "the large scope keeps its floor");
    assert_eq!(small[..24], [4; 24], "{small:?}");
    assert_eq!(small[24..], [0; 6], "{small:?}");
    assert_eq!(kept[24..], [0; 6], "{kept:?}");
    // Without a floor, the largest always gives way: everyone ends with
    // its share (100 / 31 scopes: 3 or 4).
    let c = Cache::new(
        CacheConfig {
            max_entries: 100,
            scope_floor: Some(0),
            ..CacheConfig::default()
        },
        None,
    )
    .unwrap();
    fill(&c, "team:big", 40, 10, 0).await;
    for i in 0..30 {
        assert_eq!(
            fill(&c, &format!("principal:ip:10.0.0.{i}"), 5, 10, 0).await,
            5
        );
    }
    assert!((3..=4).contains(&held(&c, "team:big", 40, 1).await));
    for i in 0..30 {
        let n = held(&c, &format!("principal:ip:10.0.0.{i}"), 5, 1).await;
        assert!((3..=4).contains(&n), "{n}");
    }
}

#[tokio::test]
async fn the_byte_bound_is_shared_by_scope_too() {
    let one = Stored {
        model: "m".into(),
        entry: entry(&"x".repeat(1000), 3),
        stored_at_ms: 0,
        expires_at_ms: 0,
        context: None,
        vector: None,
        scope: Some(scope_id("team:a")),
    }
    .bytes(&hash("team:a/0"));
    // Room for 20 such answers; a holds 5, then b stores 100.
    let c = bounded_cache(1000, one * 20, None);
    fill(&c, "team:a", 5, 1000, 0).await;
    fill(&c, "team:b", 100, 1000, 0).await;
    assert_eq!(held(&c, "team:a", 5, 1).await, 5);
    assert_eq!(held(&c, "team:b", 100, 1).await, 15);
    assert!(c.size().await.1 <= one * 20);
    // A bad scope id is refused, naming the field.
    let mut req = store_req("z", "z", None);
    req.scope = Some("team:a".into());
    let bad = c.store(req, 0).await.unwrap_err();
    assert!(bad.to_string().starts_with("scope:"), "{bad}");
}

#[tokio::test]
async fn purge_by_scope_and_model_takes_the_vectors_too() {
    let url = mock_llm().await;
    let c = bounded_cache(1000, 64 << 20, Some(url));
    let (a, b) = (scope_id("team:a"), scope_id("team:b"));
    for (who, id) in [("a", &a), ("b", &b)] {
        for (i, model) in ["m", "m2"].into_iter().enumerate() {
            let mut req = store_req(
                &format!("{who}{i}"),
                "answer",
                Some((&format!("ctx-{who}-{model}"), "how do I enable 2FA")),
            );
            req.model = model.into();
            req.scope = Some(id.clone());
            assert!(c.store(req, 0).await.unwrap().stored);
        }
    }
    assert_eq!(c.vectors(), 4);
    // Scope a, model m2 only.
    assert_eq!(c.purge_where(Some("m2"), Some("team:a")).await.unwrap(), 1);
    assert_eq!(c.vectors(), 3);
    // The rest of scope a.
    assert_eq!(c.purge_where(None, Some("team:a")).await.unwrap(), 1);
    assert_eq!(c.vectors(), 2);
    let para = |who: &str, model: &str| {
        let mut r = lookup_req(
            "other",
            Some((&format!("ctx-{who}-{model}"), "How do I enable 2FA?")),
        );
        r.model = model.into();
        r
    };
    assert!(c.lookup(&para("a", "m"), 1).await.unwrap().hit.is_none());
    assert!(c.lookup(&para("b", "m"), 1).await.unwrap().hit.is_some());
    assert!(c.lookup(&para("b", "m2"), 1).await.unwrap().hit.is_some());
    // A scope nobody stored under: nothing.
    assert_eq!(c.purge_where(None, Some("team:zz")).await.unwrap(), 0);
    assert_eq!(c.size().await.0, 2);
}

#[test]
fn config_checks_name_the_field() {
    let parse = |y: &str| {
        crate::config::Config::from_yaml(y)
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    assert!(parse("cache: {}").is_ok());
    for (y, path) in [
        ("cache: {max_entries: 0}", "cache.max_entries"),
        ("cache: {max_bytes: 0}", "cache.max_bytes"),
        (
            "cache: {max_bytes: 10, max_entry_bytes: 11}",
            "cache.max_entry_bytes",
        ),
        ("cache: {backend: redis}", "cache.backend"),
        ("cache: {min_threshold: 0}", "cache.min_threshold"),
        ("cache: {min_threshold: 1.5}", "cache.min_threshold"),
        ("cache: {min_threshold: -0.1}", "cache.min_threshold"),
        (
            "cache: {max_entries: 10, scope_floor: 11}",
            "cache.scope_floor",
        ),
        (
            "cache: {embeddings: {url: 'ftp://x', model: m}}",
            "cache.embeddings.url",
        ),
        (
            "cache: {embeddings: {url: 'http://127.0.0.1:1/v1/embeddings', model: ''}}",
            "cache.embeddings.model",
        ),
    ] {
        let e = parse(y).unwrap_err();
        assert!(e.starts_with(path), "{y}: {e}");
    }
    let e = parse("cache: {max_entires: 3}").unwrap_err();
    assert!(e.contains("cache") && e.contains("unknown field"), "{e}");
}

/// Against a real redis-server (skipped, saying so, where there is none).
mod in_redis {
    use super::*;
    use crate::redis::testing::{connection, server};

    fn redis_cache(url: &str, embeddings: Option<String>, limits: (usize, u64)) -> Arc<Cache> {
        Cache::new(
            CacheConfig {
                max_entries: limits.0,
                max_bytes: limits.1,
                max_entry_bytes: limits.1.min(1 << 20),
                embeddings: embeddings.map(|url| EmbeddingsConfig {
                    url,
                    model: "embed".into(),
                    timeout: Duration::from_secs(5),
                    api_key_env: None,
                }),
                ..CacheConfig::default()
            },
            Some(connection(url)),
        )
        .unwrap()
    }

    #[tokio::test]
    async fn one_sidecars_answer_serves_another() {
        let Some(redis) = server() else { return };
        let a = redis_cache(&redis.url, None, (100, 1 << 20));
        let b = redis_cache(&redis.url, None, (100, 1 << 20));
        assert!(a.in_redis());
        let now = now_ms();
        assert!(
            a.store(store_req("k", "shared", None), now)
                .await
                .unwrap()
                .stored
        );
        let hit = b
            .lookup(&lookup_req("k", None), now + 2000)
            .await
            .unwrap()
            .hit
            .unwrap();
        assert_eq!((hit.entry.body.as_str(), hit.age_s), ("shared", 2));
        // Another key (another scope's): a miss.
        assert!(b
            .lookup(&lookup_req("k2", None), now)
            .await
            .unwrap()
            .hit
            .is_none());
        // Expired by its own TTL in Redis (PX) too.
        let mut short = store_req("s", "short", None);
        short.ttl_s = 1;
        a.store(short, now).await.unwrap();
        assert!(b
            .lookup(&lookup_req("s", None), now + 1001)
            .await
            .unwrap()
            .hit
            .is_none());
    }

    #[tokio::test]
    async fn purge_by_scope_in_redis() {
        let Some(redis) = server() else { return };
        let a = redis_cache(&redis.url, None, (100, 1 << 20));
        let b = redis_cache(&redis.url, None, (100, 1 << 20));
        let now = now_ms();
        for (k, scope, model) in [
            ("k1", "team:a", "m"),
            ("k2", "team:a", "m2"),
            ("k3", "team:b", "m"),
        ] {
            let mut req = store_req(k, "v", None);
            req.model = model.into();
            req.scope = Some(scope_id(scope));
            assert!(a.store(req, now).await.unwrap().stored);
        }
        let mut plain = store_req("k4", "v", None);
        plain.model = "m".into();
        a.store(plain, now).await.unwrap();
        assert_eq!(b.purge_where(Some("m"), Some("team:a")).await.unwrap(), 1);
        assert_eq!(b.purge_where(None, Some("team:a")).await.unwrap(), 1);
        let hit = |k: &'static str| {
            let a = a.clone();
            async move {
                a.lookup(&lookup_req(k, None), now)
                    .await
                    .unwrap()
                    .hit
                    .is_some()
            }
        };
        assert!(!hit("k1").await && !hit("k2").await);
        assert!(hit("k3").await && hit("k4").await);
        assert_eq!(a.size().await.0, 2);
        assert_eq!(b.purge_where(None, None).await.unwrap(), 2);
    }

    #[tokio::test]
    async fn bounds_per_scope_in_redis() {
        let Some(redis) = server() else { return };
        let c = redis_cache(&redis.url, None, (100, 64 << 20));
        let now = now_ms();
        for who in ["team:a", "team:b", "team:c", "team:d"] {
            assert_eq!(fill(&c, who, 10, 10, now).await, 10);
        }
        let flood = "principal:ip:10.9.9.9";
        assert_eq!(fill(&c, flood, 1000, 10, now).await, 1000);
        for who in ["team:a", "team:b", "team:c", "team:d"] {
            assert_eq!(held(&c, who, 10, now).await, 10, "{who} kept all");
        }
        assert_eq!(held(&c, flood, 1000, now).await, 60);
        assert_eq!(c.size().await.0, 100);
        // A purge of the flood's scope frees its share, and the counts
        // per scope follow it: another scope fills the room again without
        // evicting a.
        assert_eq!(c.purge_where(None, Some(flood)).await.unwrap(), 60);
        assert_eq!(c.size().await.0, 40);
        assert_eq!(fill(&c, "team:e", 60, 10, now).await, 60);
        assert_eq!(held(&c, "team:a", 10, now).await, 10);
        // The floor: once every scope is within it, newcomers are not
        // stored, and nobody loses an entry to them.
        c.purge(None).await.unwrap();
        assert_eq!(fill(&c, "team:big", 40, 10, now).await, 40);
        for i in 0..30 {
            fill(&c, &format!("principal:ip:10.0.0.{i}"), 5, 10, now).await;
        }
        assert_eq!(held(&c, "team:big", 40, now).await, 4);
        let mut small = Vec::new();
        for i in 0..30 {
            small.push(held(&c, &format!("principal:ip:10.0.0.{i}"), 5, now).await);
        }
        assert_eq!(small[..24], [4; 24], "{small:?}");
        assert_eq!(small[24..], [0; 6], "{small:?}");
        assert_eq!(c.size().await.0, 100);
    }

    #[tokio::test]
    async fn bounds_hold_in_redis() {
        let Some(redis) = server() else { return };
        let c = redis_cache(&redis.url, None, (5, 1 << 20));
        let now = now_ms();
        for i in 0..20 {
            c.store(store_req(&format!("k{i}"), "v", None), now + i)
                .await
                .unwrap();
        }
        let (n, _) = c.size().await;
        assert_eq!(n, 5);
        assert!(c
            .lookup(&lookup_req("k19", None), now + 30)
            .await
            .unwrap()
            .hit
            .is_some());
        assert!(c
            .lookup(&lookup_req("k0", None), now + 30)
            .await
            .unwrap()
            .hit
            .is_none());
        assert_eq!(c.stats.get("m", Kind::Exact, "evict"), 15);
        // Bytes: one entry's worth × 3.
        let one = Stored {
            model: "m".into(),
            entry: entry(&"z".repeat(1000), 3),
            stored_at_ms: 0,
            expires_at_ms: 0,
            context: None,
            vector: None,
            scope: None,
        }
        .bytes(&hash("b0"));
        let c = redis_cache(&redis.url, None, (1000, one * 3));
        c.purge(None).await.unwrap();
        for i in 0..10 {
            c.store(
                store_req(&format!("b{i}"), &"z".repeat(1000), None),
                now + i,
            )
            .await
            .unwrap();
        }
        let (n, bytes) = c.size().await;
        assert_eq!(n, 3);
        assert!(bytes <= one * 3);
        assert_eq!(c.purge(None).await.unwrap(), 3);
        assert_eq!(c.size().await, (0, 0));
    }

    #[tokio::test]
    async fn every_sidecar_learns_the_vectors() {
        let Some(redis) = server() else { return };
        let url = mock_llm().await;
        let a = redis_cache(&redis.url, Some(url.clone()), (100, 1 << 20));
        let b = redis_cache(&redis.url, Some(url), (100, 1 << 20));
        let (_tx, rx) = tokio::sync::watch::channel(false);
        tokio::spawn(b.clone().learn(rx));
        let q = "How do I enable 2FA on my account?";
        let now = now_ms();
        assert!(
            a.store(store_req("k1", "settings", Some(("ctx", q))), now)
                .await
                .unwrap()
                .stored
        );
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while b.vectors() == 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "b never learned the vector"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let hit = b
            .lookup(
                &lookup_req("k2", Some(("ctx", "how do I enable 2FA on my account"))),
                now,
            )
            .await
            .unwrap()
            .hit
            .unwrap();
        assert_eq!(
            (hit.kind, hit.entry.body.as_str()),
            (Kind::Semantic, "settings")
        );
        assert!(b
            .lookup(&lookup_req("k3", Some(("other", q))), now)
            .await
            .unwrap()
            .hit
            .is_none());
    }

    #[tokio::test]
    async fn redis_down_is_a_miss() {
        let c = redis_cache("redis://127.0.0.1:1", None, (100, 1 << 20));
        let a = c.store(store_req("k", "v", None), 0).await.unwrap();
        assert_eq!(a.reason, Some(sluice_wire::cache::NotStored::Unavailable));
        assert!(c
            .lookup(&lookup_req("k", None), 0)
            .await
            .unwrap()
            .hit
            .is_none());
        assert!(
            c.stats
                .unavailable
                .load(std::sync::atomic::Ordering::Relaxed)
                >= 2
        );
    }
}

#[test]
fn check_config_says_what_a_wide_scope_shares() {
    let envoy =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../envoy/sluice.yaml"))
            .unwrap();
    let with = envoy.replacen(
        "                            static_fallback:",
        "                            cache:\n                              salt: s3cret\n                              models:\n                                m: { exact: true, scope: global }\n                            static_fallback:",
        1,
    );
    let out = crate::check_config::check(&with).unwrap();
    assert!(out.contains("cache.models.m: scope global"), "{out}");
    let bad = with.replace("scope: global", "scope: everyone");
    let err = crate::check_config::check(&bad).unwrap_err();
    assert!(err.contains("cache"), "{err}");
}

#[test]
fn check_config_knows_the_sidecars_cache_section() {
    let ok = crate::check_config::check_any("cache: {max_bytes: 2000000, embeddings: {url: 'http://127.0.0.1:8000/v1/embeddings', model: e}}");
    assert!(ok.is_ok(), "{ok:?}");
    let bad = crate::check_config::check_any("cache: {max_entries: 0}").unwrap_err();
    assert!(bad.contains("cache.max_entries"), "{bad}");
    let bad = crate::check_config::check_any("cache: {min_threshold: 0}").unwrap_err();
    assert!(bad.contains("cache.min_threshold"), "{bad}");
    let ok = crate::check_config::check_any("cache: {min_threshold: 0.85}");
    assert!(ok.is_ok(), "{ok:?}");
}

fn semantic_cache(url: String, min_threshold: f32) -> Arc<Cache> {
    Cache::new(
        CacheConfig {
            embeddings: Some(EmbeddingsConfig {
                url,
                model: "embed".into(),
                timeout: Duration::from_secs(5),
                api_key_env: None,
            }),
            min_threshold,
            ..CacheConfig::default()
        },
        None,
    )
    .unwrap()
}

/// A caller reaching the endpoint cannot ask for "the nearest entry of
/// this context, however far": its threshold is raised to the sidecar's.
#[tokio::test]
async fn a_requests_threshold_is_raised_to_the_sidecars_minimum() {
    let url = mock_llm().await;
    let c = semantic_cache(url.clone(), 0.9);
    let q = "How do I enable 2FA on my account?";
    c.store(store_req("k1", "turn it on", Some(("conv", q))), 0)
        .await
        .unwrap();
    for t in [0.0, f32::MIN_POSITIVE, 0.01, 0.5, 0.89] {
        let mut far = lookup_req("k2", Some(("conv", "Tell me a joke about penguins")));
        far.threshold = Some(t);
        far.top_k = Some(u32::MAX);
        assert!(c.lookup(&far, 0).await.unwrap().hit.is_none(), "{t}");
        let mut near = lookup_req("k3", Some(("conv", "How do I disable 2FA on my account?")));
        near.threshold = Some(t);
        assert!(c.lookup(&near, 0).await.unwrap().hit.is_none(), "{t}");
    }
    assert_eq!(c.stats.get("m", Kind::Semantic, "hit"), 0);
    // The operator may lower it: then a request's 0.8 lets the near one in.
    let loose = semantic_cache(url, 0.8);
    loose
        .store(store_req("k1", "turn it on", Some(("conv", q))), 0)
        .await
        .unwrap();
    let mut near = lookup_req("k3", Some(("conv", "How do I disable 2FA on my account?")));
    near.threshold = Some(0.8);
    assert!(loose.lookup(&near, 0).await.unwrap().hit.is_some());
    // A request stricter than the minimum keeps its own.
    near.threshold = Some(0.99);
    assert!(loose.lookup(&near, 0).await.unwrap().hit.is_none());
}

#[test]
fn search_bounds_clamp_threshold_and_top_k() {
    assert_eq!(
        search_bounds(Some(0.0), Some(1000), 0.9),
        (0.9, MAX_TOP_K as usize)
    );
    assert_eq!(search_bounds(Some(f32::NAN), Some(0), 0.9), (1.0, 1));
    assert_eq!(search_bounds(Some(0.97), Some(3), 0.9), (0.97, 3));
    assert_eq!(search_bounds(Some(2.0), None, 0.9), (1.0, 5));
    assert_eq!(search_bounds(None, Some(u32::MAX), 0.5), (0.95, 20));
}

/// Two long last user messages sharing their first `MAX_TEXT_BYTES` are
/// different questions: neither answers the other (they used to be cut
/// there and embed the same).
#[tokio::test]
async fn texts_over_the_embedding_limit_are_exact_only() {
    use super::semantic::MAX_TEXT_BYTES;
    let c = semantic_cache(mock_llm().await, 0.9);
    let shared = "word ".repeat(MAX_TEXT_BYTES / 5 + 10);
    let a = format!("{shared} so how do I enable 2FA?");
    let b = format!("{shared} so how do I delete my account?");
    let stored = c
        .store(store_req("ka", "enable answer", Some(("conv", &a))), 0)
        .await
        .unwrap();
    assert!(stored.stored, "the exact entry is kept");
    let other = c
        .lookup(&lookup_req("kb", Some(("conv", &b))), 0)
        .await
        .unwrap();
    assert!(other.hit.is_none(), "{:?}", body_of(&other));
    assert_eq!(c.vectors(), 0, "no vector for a text over the limit");
    // Its exact key still answers it.
    let same = c
        .lookup(&lookup_req("ka", Some(("conv", &a))), 0)
        .await
        .unwrap();
    assert_eq!(same.hit.map(|h| h.kind), Some(Kind::Exact));
    assert_eq!(c.stats.get("m", Kind::Semantic, "skip"), 2);
    assert_eq!(
        c.stats
            .embedding_calls
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    // One at the limit is still embedded whole.
    let at = "a".repeat(MAX_TEXT_BYTES);
    c.store(store_req("kc", "x", Some(("conv", &at))), 0)
        .await
        .unwrap();
    assert_eq!(c.vectors(), 1);
}

/// The remembered embeddings hold hashes, not texts: 64 distinct 30 KiB
/// questions take a few vectors' worth, not 2 MiB of text.
#[tokio::test]
async fn recent_embeddings_do_not_keep_the_texts() {
    let c = semantic_cache(mock_llm().await, 0.9);
    let long = "y".repeat(30 << 10);
    for i in 0..64 {
        c.store(
            store_req(
                &format!("k{i}"),
                "a",
                Some(("conv", &format!("{long} {i}"))),
            ),
            0,
        )
        .await
        .unwrap();
    }
    let recent = lock(&c.recent);
    assert_eq!(recent.len(), 64);
    assert!(recent.bytes() < 64 * 4096, "{}", recent.bytes());
    assert!(recent.bytes() <= recent::RECENT_BYTES);
}

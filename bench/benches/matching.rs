//! Topic matching with 10,000 patterns: tinybroker's sublist trie with its
//! match cache on and off, against a naive linear scan with
//! `TopicPattern::matches` (what a broker without a trie would do).
//!
//! Run: `cargo bench -p tinybroker-bench --bench matching`
//! (add `-- --measurement-time 2 --warm-up-time 1` for a short run).

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use std::hint::black_box;
use std::time::Duration;
use tinybroker::sublist::{DEFAULT_CACHE_CAPACITY, Sublist};
use tinybroker::topic::TopicPattern;

const PATTERNS: usize = 10_000;
/// Distinct topics in the published stream (fits the default cache).
const TOPICS: usize = 2_000;

/// A small deterministic generator, so every run matches the same sets.
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 33) % n
    }
}

/// 60 % literal (`svc7.r3.ev12`), 25 % with `*`, 15 % ending in `>`,
/// over 200 services, 10 regions and 50 events.
fn patterns() -> Vec<TopicPattern> {
    let mut rng = Lcg(1);
    (0..PATTERNS)
        .map(|_| {
            let (s, r, e) = (rng.below(200), rng.below(10), rng.below(50));
            let text = match rng.below(20) {
                0..12 => format!("svc{s}.r{r}.ev{e}"),
                12..15 => format!("svc{s}.*.ev{e}"),
                15..17 => format!("svc{s}.r{r}.*"),
                17..19 => format!("svc{s}.r{r}.>"),
                _ => format!("svc{s}.>"),
            };
            TopicPattern::parse(&text).expect("generated patterns are valid")
        })
        .collect()
}

/// Published topics: mostly three tokens, some four (only `>` matches those).
fn topics() -> Vec<String> {
    let mut rng = Lcg(2);
    (0..TOPICS)
        .map(|_| {
            let (s, r, e) = (rng.below(220), rng.below(10), rng.below(50));
            if rng.below(10) == 0 {
                format!("svc{s}.r{r}.ev{e}.detail")
            } else {
                format!("svc{s}.r{r}.ev{e}")
            }
        })
        .collect()
}

fn trie(patterns: &[TopicPattern], cache: usize) -> Sublist<u64> {
    let mut s = Sublist::with_cache_capacity(cache);
    for (id, p) in patterns.iter().enumerate() {
        s.insert(p, id as u64, id as u64);
    }
    s
}

fn naive(patterns: &[(TopicPattern, u64)], topic: &str) -> Vec<u64> {
    let mut ids: Vec<u64> = patterns
        .iter()
        .filter(|(p, _)| p.matches(topic))
        .map(|(_, id)| *id)
        .collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}

fn matching(c: &mut Criterion) {
    let patterns = patterns();
    let topics = topics();
    let on = trie(&patterns, DEFAULT_CACHE_CAPACITY);
    let off = trie(&patterns, 0);
    let scan: Vec<(TopicPattern, u64)> = patterns.iter().cloned().zip(0..).collect();

    // All three agree (and the streams really match something).
    let mut total = 0;
    for t in &topics {
        let expected = naive(&scan, t);
        assert_eq!(&*on.matches(t), &expected[..], "{t}");
        assert_eq!(&*off.matches(t), &expected[..], "{t}");
        total += expected.len();
    }
    assert!(total > 0, "the topic stream matches nothing");

    let mut group = c.benchmark_group(format!("match {PATTERNS} patterns"));
    group.throughput(Throughput::Elements(topics.len() as u64));
    group.bench_function("sublist, cache on", |b| {
        b.iter(|| topics.iter().map(|t| on.matches(black_box(t)).len()).sum::<usize>())
    });
    group.bench_function("sublist, cache off", |b| {
        b.iter(|| topics.iter().map(|t| off.matches(black_box(t)).len()).sum::<usize>())
    });
    // The scan is ~1000× slower: a slice of the stream keeps it short.
    let slice = &topics[..100];
    group.throughput(Throughput::Elements(slice.len() as u64));
    group.bench_function("naive linear scan", |b| {
        b.iter(|| slice.iter().map(|t| naive(&scan, black_box(t)).len()).sum::<usize>())
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = matching
}
criterion_main!(benches);

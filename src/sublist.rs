//! Pattern matching for routing: a token trie with `*` and `>` slots and a
//! bounded cache of match results, in the spirit of nats-server's sublist.
//!
//! Each entry is a `(pattern, id, value)`; a lookup returns the values of every
//! entry whose pattern matches the topic, once per id (an id registered under
//! two matching patterns appears once), sorted by id. The cache maps a topic
//! to its last result; insert and remove drop exactly the cached topics the
//! changed pattern matches, so the cache never serves a stale result.

use crate::topic::TopicPattern;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;

/// Default number of topics whose match results are cached.
pub const DEFAULT_CACHE_CAPACITY: usize = 4096;

/// A match result, shared between the cache and every caller.
pub type Matches<T> = Arc<[T]>;

/// The routing trie. Not internally synchronised for writes: the owner wraps
/// it in a lock (reads take `&self`; the cache has its own small mutex).
pub struct Sublist<T> {
    root: Node<T>,
    cache: Mutex<Cache<T>>,
    cache_capacity: usize,
    entries: usize,
}

/// One token's node. Small, because a trie of distinct literal topics (a
/// subscription per user or key space) is mostly leaves: a leaf's node is 48
/// bytes in its parent's map, its first entry in it.
struct Node<T> {
    /// The children by literal token; None when there are none (every leaf).
    literals: Option<Box<Children<T>>>,
    /// What wildcards reach from here; None for most nodes.
    wild: Option<Box<Wild<T>>>,
    /// Entries whose pattern ends exactly at this node.
    here: Entries<T>,
}

/// A node's `*` child and its `>` entries.
struct Wild<T> {
    star: Option<Node<T>>,
    /// Entries whose pattern ends in `>` right after this node.
    rest: Entries<T>,
}

impl<T> Wild<T> {
    fn is_empty(&self) -> bool {
        self.star.is_none() && self.rest.is_empty()
    }
}

/// Hashed with foldhash, randomly seeded per map like the publishers' route
/// caches: a fraction of SipHash's cost per token, and half its state.
type Children<T> = HashMap<Box<str>, Node<T>, foldhash::fast::RandomState>;

struct Entry<T> {
    id: u64,
    value: T,
}

struct Cache<T> {
    map: HashMap<Box<str>, Matches<T>>,
    hits: u64,
    misses: u64,
}

/// Counters for tests, benchmarks and operators.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SublistStats {
    pub entries: usize,
    pub cached_topics: usize,
    pub cache_hits: u64,
    pub cache_misses: u64,
}

impl<T> Default for Node<T> {
    fn default() -> Self {
        Self {
            literals: None,
            wild: None,
            here: Entries::default(),
        }
    }
}

impl<T> Node<T> {
    fn is_empty(&self) -> bool {
        self.literals.is_none() && self.wild.is_none() && self.here.is_empty()
    }

    fn child(&self, token: &str) -> Option<&Node<T>> {
        self.literals.as_ref()?.get(token)
    }

    fn wild(&mut self) -> &mut Wild<T> {
        self.wild.get_or_insert_with(|| {
            Box::new(Wild {
                star: None,
                rest: Entries::default(),
            })
        })
    }
}

/// The entries of one place in the trie (a pattern ending at a node, or
/// its `>` after it). Most places hold one (a subscription per topic): it
/// is kept in the node itself, where a `Vec` would take an allocation of
/// its own for it (32 bytes); the second makes a `Vec` of both.
enum Entries<T> {
    One(Entry<T>),
    Many(Vec<Entry<T>>),
}

impl<T> Default for Entries<T> {
    fn default() -> Self {
        Self::Many(Vec::new())
    }
}

impl<T> Entries<T> {
    fn as_slice(&self) -> &[Entry<T>] {
        match self {
            Self::One(entry) => std::slice::from_ref(entry),
            Self::Many(entries) => entries,
        }
    }

    fn is_empty(&self) -> bool {
        matches!(self, Self::Many(entries) if entries.is_empty())
    }

    fn push(&mut self, entry: Entry<T>) {
        match self {
            Self::Many(entries) if entries.is_empty() => *self = Self::One(entry),
            Self::Many(entries) => entries.push(entry),
            Self::One(_) => {
                let Self::One(first) = std::mem::take(self) else {
                    unreachable!("matched One above")
                };
                *self = Self::Many(vec![first, entry]);
            }
        }
    }

    /// Removes the entry `id`; false when there was none. The last one
    /// leaves nothing allocated behind.
    fn take(&mut self, id: u64) -> bool {
        match self {
            Self::One(entry) if entry.id == id => *self = Self::default(),
            Self::One(_) => return false,
            Self::Many(entries) => {
                let Some(i) = entries.iter().position(|e| e.id == id) else {
                    return false;
                };
                entries.swap_remove(i);
                if entries.is_empty() {
                    *self = Self::default();
                }
            }
        }
        true
    }
}

impl<T: Clone> Default for Sublist<T> {
    fn default() -> Self {
        Self::with_cache_capacity(DEFAULT_CACHE_CAPACITY)
    }
}

impl<T: Clone> Sublist<T> {
    /// A trie whose cache holds at most `capacity` topics (0 turns it off).
    pub fn with_cache_capacity(capacity: usize) -> Self {
        Self {
            root: Node::default(),
            cache: Mutex::new(Cache {
                map: HashMap::new(),
                hits: 0,
                misses: 0,
            }),
            cache_capacity: capacity,
            entries: 0,
        }
    }

    /// Adds `value` under `id` for `pattern`. Registering the same id twice
    /// for one pattern is the caller's bug; lookups still return it once.
    pub fn insert(&mut self, pattern: &TopicPattern, id: u64, value: T) {
        let mut node = &mut self.root;
        let mut tokens = pattern.tokens().peekable();
        while let Some(token) = tokens.next() {
            if token == ">" && tokens.peek().is_none() {
                node.wild().rest.push(Entry { id, value });
                self.entries += 1;
                self.invalidate(pattern);
                return;
            }
            node = if token == "*" {
                node.wild().star.get_or_insert_with(Default::default)
            } else {
                node.literals
                    .get_or_insert_with(Default::default)
                    .entry(token.into())
                    .or_default()
            };
        }
        node.here.push(Entry { id, value });
        self.entries += 1;
        self.invalidate(pattern);
    }

    /// True when it holds no entry: nothing matches any topic.
    pub fn is_empty(&self) -> bool {
        self.entries == 0
    }

    /// Removes the entry `id` of `pattern`; false when there was none.
    pub fn remove(&mut self, pattern: &TopicPattern, id: u64) -> bool {
        let tokens: Vec<&str> = pattern.tokens().collect();
        let removed = remove_at(&mut self.root, &tokens, id);
        if removed {
            self.entries -= 1;
            self.invalidate(pattern);
        }
        removed
    }

    /// Every value whose pattern matches `topic`, once per id, by id.
    pub fn matches(&self, topic: &str) -> Matches<T> {
        if self.cache_capacity > 0 {
            let mut cache = self.cache.lock();
            if let Some(hit) = cache.map.get(topic) {
                let hit = hit.clone();
                cache.hits += 1;
                return hit;
            }
            cache.misses += 1;
        }
        let tokens: Vec<&str> = topic.split('.').collect();
        let mut found: Vec<(u64, &T)> = Vec::new();
        collect(&self.root, &tokens, &mut found);
        found.sort_unstable_by_key(|(id, _)| *id);
        found.dedup_by_key(|(id, _)| *id);
        let result: Matches<T> = found.into_iter().map(|(_, v)| v.clone()).collect();
        if self.cache_capacity > 0 {
            let mut cache = self.cache.lock();
            if cache.map.len() >= self.cache_capacity {
                // Bounded: drop an arbitrary quarter, as nats-server prunes.
                let drop_n = (self.cache_capacity / 4).max(1);
                let victims: Vec<Box<str>> = cache.map.keys().take(drop_n).cloned().collect();
                for victim in victims {
                    cache.map.remove(&victim);
                }
            }
            cache.map.insert(topic.into(), result.clone());
        }
        result
    }

    pub fn stats(&self) -> SublistStats {
        let cache = self.cache.lock();
        SublistStats {
            entries: self.entries,
            cached_topics: cache.map.len(),
            cache_hits: cache.hits,
            cache_misses: cache.misses,
        }
    }

    fn invalidate(&self, pattern: &TopicPattern) {
        if self.cache_capacity > 0 {
            self.cache.lock().map.retain(|topic, _| !pattern.matches(topic));
        }
    }
}

fn collect<'a, T>(node: &'a Node<T>, tokens: &[&str], found: &mut Vec<(u64, &'a T)>) {
    let Some((first, rest)) = tokens.split_first() else {
        found.extend(node.here.as_slice().iter().map(|e| (e.id, &e.value)));
        return;
    };
    // `>` after this node takes one or more tokens: at least `first` remains.
    let Some(wild) = &node.wild else {
        if let Some(child) = node.child(first) {
            collect(child, rest, found);
        }
        return;
    };
    found.extend(wild.rest.as_slice().iter().map(|e| (e.id, &e.value)));
    if let Some(child) = node.child(first) {
        collect(child, rest, found);
    }
    if let Some(star) = &wild.star {
        collect(star, rest, found);
    }
}

fn remove_at<T>(node: &mut Node<T>, tokens: &[&str], id: u64) -> bool {
    match tokens {
        [] => node.here.take(id),
        [">"] | ["*", ..] => {
            let Some(wild) = node.wild.as_deref_mut() else {
                return false;
            };
            let removed = match tokens {
                [">"] => wild.rest.take(id),
                [_, rest @ ..] => {
                    let Some(star) = wild.star.as_mut() else {
                        return false;
                    };
                    let removed = remove_at(star, rest, id);
                    if removed && star.is_empty() {
                        wild.star = None;
                    }
                    removed
                }
                [] => unreachable!("matched a token above"),
            };
            if removed && wild.is_empty() {
                node.wild = None;
            }
            removed
        }
        [first, rest @ ..] => {
            let Some(children) = node.literals.as_deref_mut() else {
                return false;
            };
            let Some(child) = children.get_mut(*first) else {
                return false;
            };
            let removed = remove_at(child, rest, id);
            if removed && child.is_empty() {
                children.remove(*first);
                if children.is_empty() {
                    node.literals = None;
                }
            }
            removed
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn p(s: &str) -> TopicPattern {
        TopicPattern::parse(s).unwrap()
    }

    /// Runs a scenario with the cache on and with it off.
    fn both(f: impl Fn(Sublist<u64>)) {
        f(Sublist::with_cache_capacity(DEFAULT_CACHE_CAPACITY));
        f(Sublist::with_cache_capacity(0));
    }

    #[test]
    fn table_of_cases() {
        both(|mut s| {
            let patterns = ["deploy.*", "deploy.>", "deploy.rollout", "*.rollout", ">", "a.*.c"];
            for (id, pat) in patterns.iter().enumerate() {
                s.insert(&p(pat), id as u64, id as u64);
            }
            let cases: &[(&str, &[u64])] = &[
                ("deploy.rollout", &[0, 1, 2, 3, 4]),
                ("deploy.a", &[0, 1, 4]),
                ("deploy.a.b", &[1, 4]),
                ("deploy", &[4]),
                ("x.rollout", &[3, 4]),
                ("a.b.c", &[4, 5]),
                ("a.b.d", &[4]),
            ];
            for (topic, expected) in cases {
                assert_eq!(&*s.matches(topic), *expected, "{topic}");
                // Twice: the second answer may come from the cache.
                assert_eq!(&*s.matches(topic), *expected, "{topic} (again)");
            }
        });
    }

    #[test]
    fn one_result_per_id_even_when_two_patterns_match() {
        both(|mut s| {
            s.insert(&p("deploy.*"), 7, 7);
            s.insert(&p("deploy.>"), 7, 7);
            s.insert(&p("deploy.rollout"), 7, 7);
            assert_eq!(&*s.matches("deploy.rollout"), &[7]);
        });
    }

    #[test]
    fn insert_and_remove_keep_the_cache_correct() {
        let mut s = Sublist::with_cache_capacity(16);
        assert!(s.is_empty());
        assert!(s.matches("a.b").is_empty());
        s.insert(&p("a.*"), 1, 1);
        assert!(!s.is_empty());
        assert_eq!(&*s.matches("a.b"), &[1]);
        s.insert(&p("a.>"), 2, 2);
        assert_eq!(&*s.matches("a.b"), &[1, 2]);
        assert!(s.remove(&p("a.*"), 1));
        assert_eq!(&*s.matches("a.b"), &[2]);
        assert!(!s.remove(&p("a.*"), 1));
        assert!(s.remove(&p("a.>"), 2));
        assert!(s.matches("a.b").is_empty());
        assert_eq!(s.stats().entries, 0);
        assert!(s.is_empty());
        assert!(s.root.is_empty(), "removal prunes empty nodes");
    }

    #[test]
    fn cache_is_bounded_and_counts_hits() {
        let mut s = Sublist::with_cache_capacity(8);
        s.insert(&p(">"), 1, 1);
        for i in 0..100 {
            s.matches(&format!("t.{i}"));
        }
        assert!(s.stats().cached_topics <= 8);
        s.matches("t.99");
        let stats = s.stats();
        assert_eq!(stats.cache_misses, 100);
        assert_eq!(stats.cache_hits, 1);
    }

    fn token() -> impl Strategy<Value = String> {
        prop_oneof![Just("a".to_string()), Just("b".to_string()), Just("c".to_string())]
    }

    fn topic() -> impl Strategy<Value = String> {
        prop::collection::vec(token(), 1..5).prop_map(|t| t.join("."))
    }

    fn pattern() -> impl Strategy<Value = String> {
        let tok = prop_oneof![4 => token(), 2 => Just("*".to_string())];
        (prop::collection::vec(tok, 1..5), any::<bool>()).prop_map(|(mut t, gt)| {
            if gt {
                t.push(">".into());
            }
            t.join(".")
        })
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(String, u64),
        Remove(usize),
        Match(String),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (pattern(), 0u64..20).prop_map(|(p, id)| Op::Insert(p, id)),
            1 => any::<usize>().prop_map(Op::Remove),
            4 => topic().prop_map(Op::Match),
        ]
    }

    proptest! {
        #[test]
        fn trie_agrees_with_naive_matcher(ops in prop::collection::vec(op(), 1..80), cache in prop_oneof![Just(0usize), Just(3), Just(64)]) {
            let mut trie: Sublist<u64> = Sublist::with_cache_capacity(cache);
            let mut naive: Vec<(TopicPattern, u64)> = Vec::new();
            for op in ops {
                match op {
                    Op::Insert(pat, id) => {
                        let pat = p(&pat);
                        if naive.iter().any(|(q, i)| *q == pat && *i == id) {
                            continue;
                        }
                        trie.insert(&pat, id, id);
                        naive.push((pat, id));
                    }
                    Op::Remove(i) => {
                        if naive.is_empty() { continue; }
                        let (pat, id) = naive.remove(i % naive.len());
                        prop_assert!(trie.remove(&pat, id));
                    }
                    Op::Match(topic) => {
                        let mut expected: Vec<u64> = naive.iter().filter(|(q, _)| q.matches(&topic)).map(|(_, id)| *id).collect();
                        expected.sort_unstable();
                        expected.dedup();
                        prop_assert_eq!(&*trie.matches(&topic), &expected[..], "topic {}", topic);
                    }
                }
            }
            prop_assert_eq!(trie.stats().entries, naive.len());
            // Removing the rest leaves no node behind: no `*` child, `>`
            // list or literal map outlives its last entry.
            for (pat, id) in naive.drain(..) {
                prop_assert!(trie.remove(&pat, id));
            }
            prop_assert!(trie.root.is_empty(), "removal prunes empty nodes");
        }
    }

    /// A trie of distinct literal topics is mostly leaves: a leaf is 48
    /// bytes in its parent's map, its one entry in it (ARCHITECTURE.md,
    /// "What an idle subscription holds"; the guard's `idle-session`
    /// measures the whole).
    #[test]
    fn a_node_is_48_bytes_with_its_first_entry() {
        assert_eq!(std::mem::size_of::<Node<[usize; 2]>>(), 48);
    }

    /// One entry is kept in its node, a second makes a list of both, and
    /// removing them in either order leaves the place empty (nothing
    /// allocated) and each removal finds only its own entry.
    #[test]
    fn entries_hold_one_in_place_and_more_in_a_list() {
        let entry = |id| Entry { id, value: id * 10 };
        for order in [[1, 2], [2, 1]] {
            let mut entries = Entries::default();
            assert!(entries.is_empty());
            entries.push(entry(1));
            assert!(matches!(entries, Entries::One(_)));
            entries.push(entry(2));
            let ids: Vec<u64> = entries.as_slice().iter().map(|e| e.id).collect();
            assert_eq!(ids, [1, 2]);
            assert!(!entries.take(3));
            assert!(entries.take(order[0]));
            assert_eq!(entries.as_slice().len(), 1);
            assert_eq!(entries.as_slice()[0].value, order[1] * 10);
            assert!(!entries.take(order[0]));
            assert!(entries.take(order[1]));
            assert!(entries.is_empty());
            assert!(matches!(&entries, Entries::Many(v) if v.capacity() == 0));
        }
        let mut one = Entries::default();
        one.push(entry(7));
        assert!(!one.take(8));
        assert!(one.take(7));
        assert!(one.is_empty());
    }
}

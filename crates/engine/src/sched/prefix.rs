//! The prefix cache: sequence states saved by the exact tokens they have
//! consumed, so a request whose prompt starts with those tokens starts from
//! a copy of the state and prefills only the rest.
//!
//! By the row contract a state after tokens `t[..n]` is the same bytes
//! however those tokens were chunked, so restoring it and prefilling
//! `prompt[n..]` gives the bytes the whole prompt gives cold. Keys are token
//! sequences, never text, and a lookup takes only an entry whose tokens are a
//! prefix of the prompt and shorter than it (the prompt's last token is
//! always fed: its logits choose the first generated token).
//!
//! Entries are copies ([`crate::Backend::fork_state`]) that no
//! request runs on: a request gets a copy of an entry, so evicting an entry
//! never touches a running request's state. The budget counts each entry's
//! KV rows (rounded up to whole [`KV_BLOCK`]s, what both backends
//! allocate) and recurrent states at full size, also where KV blocks are
//! shared between entries and running requests (a fork shares them until
//! written): the bytes counted are an upper bound of what the entries hold. Past the budget the least recently used
//! entries go first.

use crate::KvType;
use crate::model::HParams;
use crate::state::{KV_BLOCK, kv_bytes_per_token, recurrent_bytes};

/// Bytes an entry of a state at position `pos` is counted at: its KV rows
/// (whole blocks) and its recurrent states. The same count reserves a
/// running request's whole context against the KV budget
/// ([`super::Config::kv_budget`]).
pub fn entry_bytes(hp: &HParams, kv: KvType, pos: usize) -> u64 {
    let rows = pos.div_ceil(KV_BLOCK) as u64 * KV_BLOCK as u64;
    rows.saturating_mul(kv_bytes_per_token(hp, kv))
        .saturating_add(recurrent_bytes(hp))
}

struct Entry<S> {
    tokens: Vec<u32>,
    state: S,
    bytes: u64,
    used: u64,
}

/// Saved states keyed by the tokens they consumed, within a byte budget.
pub struct PrefixCache<S> {
    budget: u64,
    bytes: u64,
    clock: u64,
    evictions: u64,
    entries: Vec<Entry<S>>,
}

impl<S> PrefixCache<S> {
    /// An empty cache holding at most `budget` bytes (0: disabled).
    pub fn new(budget: u64) -> Self {
        PrefixCache {
            budget,
            bytes: 0,
            clock: 0,
            evictions: 0,
            entries: Vec::new(),
        }
    }

    /// Whether the cache can hold anything.
    pub fn enabled(&self) -> bool {
        self.budget > 0
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no entry is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Bytes the entries are counted at (at most the budget).
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Entries evicted so far.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// The longest entry whose tokens are a prefix of `prompt` and shorter
    /// than it: its length and state (marked as just used).
    pub fn lookup(&mut self, prompt: &[u32]) -> Option<(usize, &S)> {
        let best = self
            .entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.tokens.len() < prompt.len() && prompt.starts_with(&e.tokens))
            .max_by_key(|(_, e)| e.tokens.len())
            .map(|(i, _)| i)?;
        let now = self.tick();
        let e = &mut self.entries[best];
        e.used = now;
        Some((e.tokens.len(), &e.state))
    }

    /// Whether an entry of `tokens`, counted at `bytes`, would be taken:
    /// the cache is on, the entry fits the budget and none of these tokens
    /// is held (one that is, is marked as just used). Asked before a state
    /// is copied for [`PrefixCache::insert`].
    pub fn wants(&mut self, tokens: &[u32], bytes: u64) -> bool {
        if !self.enabled() || tokens.is_empty() || bytes > self.budget {
            return false;
        }
        let now = self.tick();
        match self.entries.iter_mut().find(|e| e.tokens == tokens) {
            Some(e) => {
                e.used = now;
                false
            }
            None => true,
        }
    }

    /// Hold `state` (which has consumed exactly `tokens`), counted at
    /// `bytes`, evicting the least recently used entries until it fits. An
    /// entry over the whole budget is dropped; one of the same tokens is
    /// replaced.
    pub fn insert(&mut self, tokens: Vec<u32>, state: S, bytes: u64) {
        if !self.enabled() || tokens.is_empty() || bytes > self.budget {
            return;
        }
        if let Some(i) = self.entries.iter().position(|e| e.tokens == tokens) {
            let old = self.entries.swap_remove(i);
            self.bytes -= old.bytes;
        }
        while self.bytes + bytes > self.budget {
            let Some(lru) = self
                .entries
                .iter()
                .enumerate()
                .min_by_key(|(_, e)| e.used)
                .map(|(i, _)| i)
            else {
                break;
            };
            let old = self.entries.swap_remove(lru);
            self.bytes -= old.bytes;
            self.evictions += 1;
        }
        let used = self.tick();
        self.bytes += bytes;
        self.entries.push(Entry {
            tokens,
            state,
            bytes,
            used,
        });
    }

    /// Drop every entry (to give their memory to a request that could not
    /// get any).
    pub fn clear(&mut self) {
        self.evictions += self.entries.len() as u64;
        self.entries.clear();
        self.bytes = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::PrefixCache;

    #[test]
    fn lookup_takes_the_longest_shorter_prefix() {
        let mut c = PrefixCache::new(100);
        c.insert(vec![1, 2], 'a', 10);
        c.insert(vec![1, 2, 3, 4], 'b', 10);
        c.insert(vec![1, 5], 'c', 10);
        c.insert(vec![1, 2, 3, 4, 5, 6], 'd', 10);
        assert_eq!(c.lookup(&[1, 2, 3, 4, 5]), Some((4, &'b')));
        assert_eq!(c.lookup(&[1, 2, 3]), Some((2, &'a')));
        // The whole prompt is never taken: its last token must be fed.
        assert_eq!(c.lookup(&[1, 2]), None);
        assert_eq!(c.lookup(&[1, 2, 3, 4]), Some((2, &'a')));
        assert_eq!(c.lookup(&[1, 5, 0]), Some((2, &'c')));
        assert_eq!(c.lookup(&[2, 1, 2, 3]), None);
        assert_eq!(c.lookup(&[]), None);
    }

    #[test]
    fn the_least_recently_used_go_first_and_the_budget_holds() {
        let mut c = PrefixCache::new(30);
        c.insert(vec![1], 1, 10);
        c.insert(vec![2], 2, 10);
        c.insert(vec![3], 3, 10);
        assert_eq!((c.len(), c.bytes()), (3, 30));
        // Using [1] makes [2] the oldest.
        assert!(c.lookup(&[1, 9]).is_some());
        c.insert(vec![4], 4, 10);
        assert_eq!(c.lookup(&[2, 9]), None);
        assert!(c.lookup(&[1, 9]).is_some());
        assert_eq!(c.evictions(), 1);
        // A big entry evicts as many as it needs.
        c.insert(vec![5], 5, 25);
        assert_eq!((c.len(), c.bytes()), (1, 25));
        assert_eq!(c.evictions(), 4);
        // Over the whole budget: not taken, nothing evicted.
        assert!(!c.wants(&[6], 31));
        c.insert(vec![6], 6, 31);
        assert_eq!((c.len(), c.bytes()), (1, 25));
        for i in 0..100u32 {
            c.insert(vec![i, i], i, 7);
            assert!(c.bytes() <= 30 && c.len() <= 4);
        }
    }

    #[test]
    fn a_held_key_is_not_wanted_again_and_a_disabled_cache_holds_nothing() {
        let mut c = PrefixCache::new(100);
        assert!(c.wants(&[1, 2], 10));
        c.insert(vec![1, 2], 0, 10);
        assert!(!c.wants(&[1, 2], 10));
        c.insert(vec![1, 2], 1, 20);
        assert_eq!((c.len(), c.bytes()), (1, 20));
        assert_eq!(c.lookup(&[1, 2, 3]), Some((2, &1)));
        assert!(!c.wants(&[], 1));
        c.clear();
        assert!(c.is_empty() && c.bytes() == 0);
        let mut off = PrefixCache::new(0);
        assert!(!off.enabled() && !off.wants(&[1], 0));
        off.insert(vec![1], 0, 0);
        assert!(off.is_empty() && off.lookup(&[1, 2]).is_none());
    }
}

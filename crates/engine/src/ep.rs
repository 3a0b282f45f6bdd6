//! Expert parallelism: the routed experts of every layer split across ranks
//! (GPUs), and the exchange that sends each (token, slot) pair's row to the
//! rank holding its expert and the result back.
//!
//! The plan is host logic shared by every transport: [`Placement`] gives each
//! rank a contiguous slice of the experts, [`Exchange`] lists, for every
//! (source, destination) rank pair, the pairs the source sends, in one
//! canonical order (expert, then pair index). An all-to-all moves the rows in
//! that order; the destination runs its experts over what it received; the
//! reverse all-to-all returns one result row per pair in the same order; the
//! token's owner scatters the results by pair index and combines each token's
//! slots in slot order, exactly as one device does. No sum is split across
//! ranks and every row is computed on its own (the row contract), so the
//! output bytes equal the one-device run whatever the rank count, the
//! placement or which rank owns which token.

use std::ops::Range;

use thiserror::Error;

use crate::plan::Plan;

/// A plan that cannot be built.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum EpError {
    /// No ranks, or more ranks than experts (a rank would hold none).
    #[error("cannot split {experts} experts over {ranks} ranks (need 1 to {experts} ranks)")]
    Ranks {
        /// Experts a layer.
        experts: usize,
        /// Ranks asked for.
        ranks: usize,
    },
    /// The expert slices do not fit the ranks' memory.
    #[error(
        "the routed experts need {need} bytes per rank at best ({experts} experts of {per_expert} bytes over {ranks} ranks), but rank {rank} has {have} bytes free"
    )]
    Memory {
        /// Experts a layer.
        experts: usize,
        /// Bytes of one expert index over all layers.
        per_expert: u64,
        /// Ranks.
        ranks: usize,
        /// The first rank short of memory.
        rank: usize,
        /// Bytes its slice needs.
        need: u64,
        /// Bytes it has.
        have: u64,
    },
    /// A token's owner names no rank.
    #[error("token {token} is owned by rank {owner}, but there are {ranks} ranks")]
    Owner {
        /// The token.
        token: usize,
        /// Its owner.
        owner: u32,
        /// Ranks.
        ranks: usize,
    },
    /// The owner list and the routing disagree on the token count.
    #[error("{ids} expert ids at {k} a token, but owners for {owners} tokens")]
    Tokens {
        /// Expert ids given.
        ids: usize,
        /// Slots a token.
        k: usize,
        /// Owners given.
        owners: usize,
    },
}

/// Which rank holds which experts: rank `r` holds `starts[r]..starts[r + 1]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    starts: Vec<usize>,
}

impl Placement {
    /// `n_expert` experts over `ranks` ranks in contiguous slices whose sizes
    /// differ by at most one (the first `n_expert % ranks` ranks hold one
    /// more).
    pub fn even(n_expert: usize, ranks: usize) -> Result<Placement, EpError> {
        if ranks == 0 || ranks > n_expert {
            return Err(EpError::Ranks {
                experts: n_expert,
                ranks,
            });
        }
        let (base, extra) = (n_expert / ranks, n_expert % ranks);
        let mut starts = Vec::with_capacity(ranks + 1);
        starts.push(0);
        for r in 0..ranks {
            let next = starts[r] + base + usize::from(r < extra);
            starts.push(next);
        }
        Ok(Placement { starts })
    }

    /// An even placement checked against each rank's free memory: each rank
    /// must hold its slice of `per_expert`-byte experts (all layers of one
    /// expert index together) within `free[rank]` bytes.
    pub fn fitting(n_expert: usize, per_expert: u64, free: &[u64]) -> Result<Placement, EpError> {
        let p = Placement::even(n_expert, free.len())?;
        for (r, &have) in free.iter().enumerate() {
            let need = p.experts(r).len() as u64 * per_expert;
            if need > have {
                return Err(EpError::Memory {
                    experts: n_expert,
                    per_expert,
                    ranks: free.len(),
                    rank: r,
                    need,
                    have,
                });
            }
        }
        Ok(p)
    }

    /// The number of ranks.
    pub fn ranks(&self) -> usize {
        self.starts.len() - 1
    }

    /// The number of experts.
    pub fn n_expert(&self) -> usize {
        *self.starts.last().unwrap_or(&0)
    }

    /// The experts rank `r` holds.
    pub fn experts(&self, r: usize) -> Range<usize> {
        self.starts[r]..self.starts[r + 1]
    }

    /// The rank holding expert `e`.
    pub fn rank_of(&self, e: usize) -> usize {
        // The last start not above e (slices are never empty).
        self.starts.partition_point(|&s| s <= e) - 1
    }
}

/// The pairs each rank sends each other rank for one MoE call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exchange {
    ranks: usize,
    k: usize,
    /// `send[src * ranks + dst]`: pair indices (`token * k + slot`) of tokens
    /// owned by `src` routed to experts on `dst`, by expert, then pair index.
    send: Vec<Vec<u32>>,
    /// The expert of each pair in `send`, alongside.
    expert: Vec<Vec<u32>>,
}

impl Exchange {
    /// The exchange for expert ids `ids` (`tokens * k`, -1 = skipped slot),
    /// token `t` owned by rank `owner[t]`.
    pub fn build(
        ids: &[i32],
        k: usize,
        owner: &[u32],
        placement: &Placement,
    ) -> Result<Exchange, EpError> {
        let ranks = placement.ranks();
        if k == 0 || ids.len() != owner.len() * k {
            return Err(EpError::Tokens {
                ids: ids.len(),
                k,
                owners: owner.len(),
            });
        }
        if let Some((token, &o)) = owner
            .iter()
            .enumerate()
            .find(|(_, o)| **o as usize >= ranks)
        {
            return Err(EpError::Owner {
                token,
                owner: o,
                ranks,
            });
        }
        // The one-device plan already groups pairs by expert in pair order;
        // walking it expert by expert gives every list its canonical order.
        let n_expert = placement.n_expert();
        let plan = Plan::build(ids, n_expert, 1);
        let mut send = vec![Vec::new(); ranks * ranks];
        let mut expert = vec![Vec::new(); ranks * ranks];
        for e in 0..n_expert {
            let dst = placement.rank_of(e);
            for &p in plan.expert(e) {
                let src = owner[p as usize / k] as usize;
                send[src * ranks + dst].push(p);
                expert[src * ranks + dst].push(e as u32);
            }
        }
        Ok(Exchange {
            ranks,
            k,
            send,
            expert,
        })
    }

    /// The number of ranks.
    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// The pairs `src` sends `dst` (rows of `src`'s tokens), in order.
    pub fn pairs(&self, src: usize, dst: usize) -> &[u32] {
        &self.send[src * self.ranks + dst]
    }

    /// The expert of each of [`Exchange::pairs`]`(src, dst)`.
    pub fn experts(&self, src: usize, dst: usize) -> &[u32] {
        &self.expert[src * self.ranks + dst]
    }

    /// Rows `src` sends `dst` (and `dst` returns): the all-to-all's counts.
    pub fn counts(&self) -> Vec<Vec<usize>> {
        (0..self.ranks)
            .map(|s| (0..self.ranks).map(|d| self.pairs(s, d).len()).collect())
            .collect()
    }

    /// What `dst` receives, sources in rank order: (source, pair, expert) per
    /// row of its receive buffer. Its experts run over these rows; it returns
    /// result row `i` to the source of row `i`.
    pub fn received(&self, dst: usize) -> Vec<(usize, u32, u32)> {
        (0..self.ranks)
            .flat_map(|s| {
                self.pairs(s, dst)
                    .iter()
                    .zip(self.experts(s, dst))
                    .map(move |(&p, &e)| (s, p, e))
            })
            .collect()
    }

    /// The token of a pair.
    pub fn token(&self, pair: u32) -> usize {
        pair as usize / self.k
    }
}

/// Token owners for `tokens` tokens split into `ranks` contiguous blocks
/// (the first `tokens % ranks` one longer): data parallelism over the rows
/// of a step.
pub fn block_owners(tokens: usize, ranks: usize) -> Vec<u32> {
    let ranks = ranks.max(1);
    let (base, extra) = (tokens / ranks, tokens % ranks);
    let mut out = Vec::with_capacity(tokens);
    for r in 0..ranks {
        let n = base + usize::from(r < extra);
        out.extend(std::iter::repeat_n(r as u32, n));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rng(seed: &mut u64) -> u64 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        *seed
    }

    #[test]
    fn even_placement_covers_every_expert_once() {
        for n in 1..40 {
            for r in 1..=n.min(9) {
                let p = Placement::even(n, r).unwrap();
                assert_eq!(p.ranks(), r);
                assert_eq!(p.n_expert(), n);
                let sizes: Vec<usize> = (0..r).map(|i| p.experts(i).len()).collect();
                assert!(
                    sizes.iter().all(|&s| s == n / r || s == n / r + 1),
                    "{sizes:?}"
                );
                assert_eq!(sizes.iter().sum::<usize>(), n);
                for e in 0..n {
                    assert!(
                        p.experts(p.rank_of(e)).contains(&e),
                        "expert {e} of {n} over {r}"
                    );
                }
            }
        }
    }

    #[test]
    fn bad_rank_counts_and_memory_are_errors() {
        assert_eq!(
            Placement::even(8, 0),
            Err(EpError::Ranks {
                experts: 8,
                ranks: 0
            })
        );
        assert!(Placement::even(8, 9).is_err());
        // 128 experts of 1 GiB over two ranks: 64 GiB each.
        let gib = 1u64 << 30;
        assert!(Placement::fitting(128, gib, &[70 * gib, 70 * gib]).is_ok());
        let err = Placement::fitting(128, gib, &[70 * gib, 60 * gib]).unwrap_err();
        assert!(matches!(err, EpError::Memory { rank: 1, .. }), "{err:?}");
        assert!(err.to_string().contains("rank 1"), "{err}");
    }

    #[test]
    fn exchange_sends_every_routed_pair_once_in_canonical_order() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        for &(n_expert, k) in &[(8usize, 2usize), (128, 8), (512, 10), (3, 3)] {
            for ranks in 1..=4.min(n_expert) {
                let placement = Placement::even(n_expert, ranks).unwrap();
                for tokens in [1usize, 2, 7, 64] {
                    let ids: Vec<i32> = (0..tokens * k)
                        .map(|_| match rng(&mut seed) % 11 {
                            0 => -1,
                            v => ((v * rng(&mut seed)) % n_expert as u64) as i32,
                        })
                        .collect();
                    let owner: Vec<u32> = (0..tokens)
                        .map(|_| (rng(&mut seed) % ranks as u64) as u32)
                        .collect();
                    let x = Exchange::build(&ids, k, &owner, &placement).unwrap();
                    let mut seen = vec![0u32; ids.len()];
                    for s in 0..ranks {
                        for d in 0..ranks {
                            let (ps, es) = (x.pairs(s, d), x.experts(s, d));
                            for (&p, &e) in ps.iter().zip(es) {
                                seen[p as usize] += 1;
                                assert_eq!(ids[p as usize], e as i32);
                                assert_eq!(owner[x.token(p)] as usize, s);
                                assert_eq!(placement.rank_of(e as usize), d);
                            }
                            // Canonical order: by expert, then pair index.
                            let keys: Vec<(u32, u32)> =
                                es.iter().copied().zip(ps.iter().copied()).collect();
                            assert!(keys.windows(2).all(|w| w[0] < w[1]), "{keys:?}");
                        }
                    }
                    for (p, &n) in seen.iter().enumerate() {
                        assert_eq!(n, u32::from(ids[p] >= 0), "pair {p}");
                    }
                    let counts = x.counts();
                    for d in 0..ranks {
                        let rec = x.received(d);
                        assert_eq!(rec.len(), counts.iter().map(|c| c[d]).sum::<usize>());
                        assert!(rec.windows(2).all(|w| w[0].0 <= w[1].0));
                    }
                }
            }
        }
    }

    #[test]
    fn bad_owners_are_errors() {
        let p = Placement::even(8, 2).unwrap();
        let ids = [0, 5, 7, 1];
        assert!(matches!(
            Exchange::build(&ids, 2, &[0, 2], &p),
            Err(EpError::Owner { token: 1, .. })
        ));
        assert!(matches!(
            Exchange::build(&ids, 2, &[0], &p),
            Err(EpError::Tokens { .. })
        ));
    }

    #[test]
    fn block_owners_split_rows_evenly() {
        assert_eq!(block_owners(7, 3), vec![0, 0, 0, 1, 1, 2, 2]);
        assert_eq!(block_owners(2, 4), vec![0, 1]);
        assert_eq!(block_owners(0, 2), Vec::<u32>::new());
    }
}

#[cfg(test)]
mod simulated;

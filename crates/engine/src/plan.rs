//! The expert plan of a chunk: which (token, slot) pairs each expert computes,
//! grouped by expert so each expert's weights are read once per chunk.
//!
//! Built the way a GPU builds it, so both backends share one definition:
//! a histogram of pairs per expert, an exclusive scan to offsets (each expert's
//! segment padded to a multiple of the kernel's row tile), and a stable placement
//! of the pairs in token order. The plan only decides which rows are computed
//! together; values never depend on it, because every row is computed on its own
//! and each token sums its experts in slot (k) order afterwards.

/// A pair that is not computed (padding, or a skipped slot with expert id -1).
pub const EMPTY: u32 = u32::MAX;

/// The plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// Pairs routed to each expert.
    pub counts: Vec<u32>,
    /// Start of each expert's segment in `pairs` (length experts + 1; segments
    /// are padded to the row tile).
    pub offsets: Vec<u32>,
    /// Pair indices `token * k + slot`, grouped by expert, in token order within
    /// an expert; padding slots hold [`EMPTY`].
    pub pairs: Vec<u32>,
}

impl Plan {
    /// Build the plan for `ids` (`tokens * k` expert ids, -1 = skipped) over
    /// `n_expert` experts, padding segments to multiples of `tile` rows.
    pub fn build(ids: &[i32], n_expert: usize, tile: usize) -> Plan {
        let tile = tile.max(1);
        let mut counts = vec![0u32; n_expert];
        for &e in ids {
            if e >= 0 && (e as usize) < n_expert {
                counts[e as usize] += 1;
            }
        }
        let mut offsets = vec![0u32; n_expert + 1];
        for e in 0..n_expert {
            let padded = (counts[e] as usize).div_ceil(tile) * tile;
            offsets[e + 1] = offsets[e] + padded as u32;
        }
        let mut pairs = vec![EMPTY; offsets[n_expert] as usize];
        let mut fill: Vec<u32> = offsets[..n_expert].to_vec();
        for (p, &e) in ids.iter().enumerate() {
            if e >= 0 && (e as usize) < n_expert {
                let at = &mut fill[e as usize];
                pairs[*at as usize] = p as u32;
                *at += 1;
            }
        }
        Plan {
            counts,
            offsets,
            pairs,
        }
    }

    /// The computed pairs of expert `e`, in token order.
    pub fn expert(&self, e: usize) -> &[u32] {
        let s = self.offsets[e] as usize;
        &self.pairs[s..s + self.counts[e] as usize]
    }

    /// Gather the input rows of expert `e`: row `i` of the result is the row of
    /// `x` (rows of `width`) of the token of the expert's `i`-th pair.
    pub fn gather(&self, e: usize, x: &[f32], width: usize, k: usize, out: &mut Vec<f32>) {
        out.clear();
        for &p in self.expert(e) {
            let t = p as usize / k;
            out.extend_from_slice(&x[t * width..(t + 1) * width]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use samesum_quant::rng::Rng;

    /// The plain reference: for each expert, scan all pairs in order.
    fn reference(ids: &[i32], n_expert: usize) -> Vec<Vec<u32>> {
        (0..n_expert)
            .map(|e| {
                ids.iter()
                    .enumerate()
                    .filter(|(_, i)| **i == e as i32)
                    .map(|(p, _)| p as u32)
                    .collect()
            })
            .collect()
    }

    #[test]
    fn plan_matches_the_plain_reference() {
        let mut rng = Rng::new(3);
        for &t in &[1usize, 2, 17, 128, 512, 2048] {
            for (e, k) in [(8usize, 2usize), (256, 8), (512, 10)] {
                for tile in [1usize, 4, 16] {
                    // Random routings with some skipped slots; each token's ids distinct.
                    let mut ids = Vec::with_capacity(t * k);
                    for _ in 0..t {
                        let mut row: Vec<i32> = Vec::new();
                        while row.len() < k {
                            let v = if rng.below(10) == 0 {
                                -1
                            } else {
                                rng.below(e as u64) as i32
                            };
                            if v == -1 || !row.contains(&v) {
                                row.push(v);
                            }
                        }
                        ids.extend(row);
                    }
                    let plan = Plan::build(&ids, e, tile);
                    let want = reference(&ids, e);
                    let total: u32 = plan.counts.iter().sum();
                    assert_eq!(total as usize, ids.iter().filter(|&&i| i >= 0).count());
                    for ex in 0..e {
                        assert_eq!(
                            plan.expert(ex),
                            want[ex].as_slice(),
                            "T={t} E={e} tile={tile} expert {ex}"
                        );
                        let seg = (plan.offsets[ex + 1] - plan.offsets[ex]) as usize;
                        assert_eq!(seg % tile, 0);
                        assert!(seg >= want[ex].len() && seg < want[ex].len() + tile);
                        let pad = &plan.pairs[plan.offsets[ex] as usize + want[ex].len()
                            ..plan.offsets[ex + 1] as usize];
                        assert!(pad.iter().all(|&p| p == EMPTY), "padding not empty");
                    }
                    // Gathered rows are the tokens' rows, in token order.
                    let width = 3;
                    let x: Vec<f32> = (0..t * width).map(|i| i as f32).collect();
                    let mut g = vec![f32::NAN; 7];
                    for ex in (0..e).step_by(e / 4) {
                        plan.gather(ex, &x, width, k, &mut g);
                        let expect: Vec<f32> = want[ex]
                            .iter()
                            .flat_map(|&p| {
                                x[(p as usize / k) * width..(p as usize / k + 1) * width].to_vec()
                            })
                            .collect();
                        assert_eq!(g, expect);
                    }
                }
            }
        }
    }
}

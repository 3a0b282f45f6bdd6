//! Sampling: greedy, temperature, top-k, top-p, min-p, a logit bias and the
//! repetition, presence and frequency penalties, in llama.cpp's order (logit
//! bias, penalties, top-k, top-p, min-p, temperature), seeded so the same seed
//! gives the same tokens.
//!
//! The penalties follow llama.cpp's `penalties` sampler: over the last
//! `repeat_last_n` tokens of the history, each token seen `count > 0` times has
//! its logit divided by `repeat_penalty` (multiplied when it is not positive),
//! then lowered by `count * frequency` and by `presence`. They act on a copy of
//! the logits used for sampling; the model's logits are never changed.

use samesum_quant::rng::Rng;

/// Sampler settings (llama.cpp's defaults, except greedy when `temp <= 0`).
#[derive(Clone, Debug, PartialEq)]
pub struct SamplerConfig {
    /// Temperature; `<= 0` means greedy.
    pub temp: f32,
    /// Keep the `top_k` most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the smallest set with probability mass `top_p` (1: all).
    pub top_p: f32,
    /// Drop tokens below `min_p` times the top probability (0: none).
    pub min_p: f32,
    /// Divide positive logits (multiply negative ones) of recent tokens by this.
    pub repeat_penalty: f32,
    /// How many recent tokens the penalty looks at.
    pub repeat_last_n: usize,
    /// Random seed.
    pub seed: u64,
}

impl Default for SamplerConfig {
    fn default() -> Self {
        SamplerConfig {
            temp: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: 0,
        }
    }
}

/// OpenAI's presence and frequency penalties (llama.cpp's `presence_penalty`
/// and `frequency_penalty`); both 0 (the default) leave sampling unchanged.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Penalties {
    /// Subtracted once from the logit of every token seen in the window.
    pub presence: f32,
    /// Subtracted from the logit of every token seen in the window, times
    /// its count there.
    pub frequency: f32,
}

/// Apply llama.cpp's `penalties` sampler to `l`: over the last `last_n`
/// tokens of `history`, each token seen `count > 0` times gets
/// `l /= repeat` (`l *= repeat` when `l <= 0`), then
/// `l -= count * p.frequency + p.presence`. Ids outside `l` are ignored.
/// With `repeat == 1` and both penalties 0, `l` is untouched.
pub fn apply_penalties(l: &mut [f32], history: &[u32], last_n: usize, repeat: f32, p: Penalties) {
    if !penalties_apply(last_n, repeat, p) {
        return;
    }
    let start = history.len().saturating_sub(last_n);
    let mut counts: std::collections::HashMap<u32, u32> = std::collections::HashMap::new();
    for &t in &history[start..] {
        if (t as usize) < l.len() {
            *counts.entry(t).or_insert(0) += 1;
        }
    }
    for (&t, &count) in &counts {
        let v = &mut l[t as usize];
        if repeat != 1.0 {
            *v = if *v > 0.0 { *v / repeat } else { *v * repeat };
        }
        if p.presence != 0.0 || p.frequency != 0.0 {
            *v -= count as f32 * p.frequency + p.presence;
        }
    }
}

/// Whether [`apply_penalties`] with these settings changes anything.
fn penalties_apply(last_n: usize, repeat: f32, p: Penalties) -> bool {
    !(last_n == 0 || (repeat == 1.0 && p.presence == 0.0 && p.frequency == 0.0))
}

/// A sampler: settings plus its random stream.
pub struct Sampler {
    cfg: SamplerConfig,
    penalties: Penalties,
    logit_bias: Vec<(u32, f32)>,
    rng: Rng,
}

impl Sampler {
    /// A sampler with `cfg` (no presence or frequency penalty).
    pub fn new(cfg: SamplerConfig) -> Self {
        let rng = Rng::new(cfg.seed);
        Sampler {
            cfg,
            penalties: Penalties::default(),
            logit_bias: Vec::new(),
            rng,
        }
    }

    /// The same sampler with presence and frequency penalties.
    pub fn with_penalties(mut self, p: Penalties) -> Self {
        self.penalties = p;
        self
    }

    /// The same sampler adding `bias` to the logit of `token` for each
    /// `(token, bias)` (OpenAI's `logit_bias`; ids outside the logits are
    /// ignored), before the penalties, as llama.cpp does.
    pub fn with_logit_bias(mut self, bias: Vec<(u32, f32)>) -> Self {
        self.logit_bias = bias;
        self
    }

    /// Whether this sampler's pick is the logits' [`argmax`] whatever the
    /// history (greedy, with no bias and no penalty in effect).
    pub fn is_plain_greedy(&self) -> bool {
        self.cfg.temp <= 0.0 && !self.edits_logits()
    }

    /// Whether a bias or penalties in effect change the logits before the
    /// pick.
    fn edits_logits(&self) -> bool {
        let c = &self.cfg;
        !self.logit_bias.is_empty()
            || penalties_apply(c.repeat_last_n, c.repeat_penalty, self.penalties)
    }

    /// Pick the next token from `logits`, given the tokens so far.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        self.sample_masked(logits, history, None)
    }

    /// [`Sampler::sample`] among the tokens `allowed` marks (all when
    /// `None`; at least one must be allowed): the others get a logit of
    /// minus infinity after the bias and the penalties (see
    /// [`crate::constraint`]).
    pub fn sample_masked(
        &mut self,
        logits: &[f32],
        history: &[u32],
        allowed: Option<&[bool]>,
    ) -> u32 {
        let c = &self.cfg;
        // The logits are copied only when something edits them (a bias,
        // penalties in effect, a mask): a 248K vocabulary is a megabyte a
        // row, and a step of many sequences samples every row.
        let edits = self.edits_logits() || allowed.is_some();
        let l: std::borrow::Cow<'_, [f32]> = if edits {
            let mut l = logits.to_vec();
            for &(t, b) in &self.logit_bias {
                if let Some(v) = l.get_mut(t as usize) {
                    *v += b;
                }
            }
            apply_penalties(
                &mut l,
                history,
                c.repeat_last_n,
                c.repeat_penalty,
                self.penalties,
            );
            if let Some(a) = allowed {
                for (v, &ok) in l.iter_mut().zip(a) {
                    if !ok {
                        *v = f32::NEG_INFINITY;
                    }
                }
            }
            std::borrow::Cow::Owned(l)
        } else {
            std::borrow::Cow::Borrowed(logits)
        };
        if c.temp <= 0.0 {
            return argmax(&l);
        }
        let cand = top_candidates(&l, c.top_k);
        let mut cand = cand;
        let probs = |cand: &[(u32, f32)], t: f32| -> Vec<f32> {
            let max = cand[0].1;
            let e: Vec<f32> = cand.iter().map(|&(_, v)| ((v - max) / t).exp()).collect();
            let s: f32 = e.iter().sum();
            e.into_iter().map(|x| x / s).collect()
        };
        if c.top_p < 1.0 {
            let p = probs(&cand, 1.0);
            let mut acc = 0.0;
            let mut keep = cand.len();
            for (i, pi) in p.iter().enumerate() {
                acc += pi;
                if acc >= c.top_p {
                    keep = i + 1;
                    break;
                }
            }
            cand.truncate(keep.max(1));
        }
        if c.min_p > 0.0 {
            let p = probs(&cand, 1.0);
            let bar = p[0] * c.min_p;
            let keep = p.iter().take_while(|&&x| x >= bar).count().max(1);
            cand.truncate(keep);
        }
        let p = probs(&cand, c.temp);
        let r = self.rng.f32();
        let mut acc = 0.0;
        for (i, pi) in p.iter().enumerate() {
            acc += pi;
            if r < acc {
                return cand[i].0;
            }
        }
        cand[cand.len() - 1].0
    }
}

/// The candidates `(id, logit)` sorted by logit, highest first, ties by
/// lower id; only the `top_k` first when `top_k > 0`. The order is a total
/// one (`total_cmp`, then the id), so the list is the full sort's first k
/// however it is found. With a top-k, one pass keeps the k best seen so far
/// sorted and compares each logit with the worst of them (most are
/// rejected by that one comparison): a 248K vocabulary's pairs are never
/// built (building and selecting them took ~0.6 ms a row).
fn top_candidates(l: &[f32], top_k: usize) -> Vec<(u32, f32)> {
    use std::cmp::Ordering;
    let order = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    if top_k == 0 || top_k >= l.len() {
        let mut cand: Vec<(u32, f32)> = l.iter().enumerate().map(|(i, &v)| (i as u32, v)).collect();
        cand.sort_unstable_by(order);
        return cand;
    }
    let mut best: Vec<(u32, f32)> = l[..top_k]
        .iter()
        .enumerate()
        .map(|(i, &v)| (i as u32, v))
        .collect();
    best.sort_unstable_by(order);
    // total_cmp's order as signed integers (its own transform of the bits).
    let key = |v: f32| {
        let b = v.to_bits() as i32;
        b ^ (((b >> 31) as u32) >> 1) as i32
    };
    let mut worst = key(best[top_k - 1].1);
    for (i, &v) in l.iter().enumerate().skip(top_k) {
        // A later id loses every tie, so only a strictly greater logit (in
        // the total order) enters.
        if key(v) <= worst {
            continue;
        }
        let c = (i as u32, v);
        let at = best.partition_point(|x| order(x, &c) == Ordering::Less);
        best.pop();
        best.insert(at, c);
        worst = key(best[top_k - 1].1);
    }
    best
}

/// Index of the largest logit (lowest index among equals; NaNs never win,
/// and a NaN first logit wins as the plain scan `if v > l[best]` leaves
/// it). Two passes that give the scan's index: the largest value by lanes
/// (`>` keeps the first of equals, so only the sign of a zero can depend
/// on the lane order, and equality ignores it), then the first index
/// holding a value equal to it; the first pass vectorizes.
pub fn argmax(l: &[f32]) -> u32 {
    const W: usize = 16;
    let Some(&first) = l.first() else {
        return 0;
    };
    if first.is_nan() {
        return 0;
    }
    let mut lanes = [first; W];
    let mut chunks = l.chunks_exact(W);
    for c in &mut chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            *m = if v > *m { v } else { *m };
        }
    }
    let mut max = first;
    for &v in lanes.iter().chain(chunks.remainder()) {
        if v > max {
            max = v;
        }
    }
    l.iter().position(|&v| v == max).unwrap_or(0) as u32
}

/// The plain scan [`argmax`] must agree with.
#[cfg(test)]
fn argmax_scan(l: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in l.iter().enumerate() {
        if v > l[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The two-pass argmax returns the plain scan's index on random rows,
    /// ties, signed zeros, infinities and NaNs anywhere (first included),
    /// at lengths around the lane width.
    #[test]
    fn argmax_equals_the_plain_scan() {
        let mut rng = Rng::new(5);
        let specials = [
            0.0f32,
            -0.0,
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            1.0,
            -1.0,
        ];
        let mut checked = 0;
        for len in [0usize, 1, 2, 15, 16, 17, 31, 33, 64, 100, 1000] {
            for trial in 0..200 {
                let row: Vec<f32> = (0..len)
                    .map(|_| match trial % 4 {
                        0 => rng.range(-4.0, 4.0),
                        1 => specials[rng.below(specials.len() as u64) as usize],
                        2 => (rng.below(3) as f32) - 1.0,
                        _ if rng.below(10) == 0 => specials[rng.below(7) as usize],
                        _ => rng.range(-1.0, 1.0),
                    })
                    .collect();
                assert_eq!(argmax(&row), argmax_scan(&row), "{row:?}");
                checked += 1;
            }
        }
        assert_eq!(argmax(&[-0.0, 0.0, -1.0]), 0);
        assert_eq!(argmax(&[-1.0, -0.0, 0.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 5.0]), 0);
        assert_eq!(argmax(&[1.0, f32::NAN, 5.0, 5.0]), 2);
        assert!(checked > 2000);
    }

    /// Greedy sampling without edits reads the logits in place and picks
    /// what the edited path picks when its edits are no-ops (a zero bias).
    #[test]
    fn greedy_without_edits_equals_the_copying_path() {
        let mut rng = Rng::new(9);
        for _ in 0..50 {
            let l: Vec<f32> = (0..4096).map(|_| rng.range(-8.0, 8.0)).collect();
            let mut plain = Sampler::new(SamplerConfig {
                temp: 0.0,
                ..Default::default()
            });
            let mut biased = Sampler::new(SamplerConfig {
                temp: 0.0,
                ..Default::default()
            })
            .with_logit_bias(vec![(3, 0.0)]);
            assert_eq!(plain.sample(&l, &[1, 2]), biased.sample(&l, &[1, 2]));
            assert_eq!(plain.sample(&l, &[]), argmax_scan(&l));
        }
    }

    #[test]
    fn top_k_selection_is_the_full_sorts_head() {
        let mut rng = Rng::new(3);
        for (n, kind) in [1usize, 2, 7, 100, 5000]
            .into_iter()
            .flat_map(|n| (0..4).map(move |k| (n, k)))
        {
            // Few distinct values, so ties (broken by id) are common;
            // infinities as a ban leaves them; NaNs (ordered by total_cmp);
            // random values; an ascending row (every logit enters).
            let mut l: Vec<f32> = match kind {
                0 => (0..n).map(|_| (rng.below(9) as f32) - 4.0).collect(),
                1 => (0..n).map(|_| rng.range(-8.0, 8.0)).collect(),
                2 => (0..n).map(|i| i as f32 * 0.5).collect(),
                _ => (0..n)
                    .map(|_| match rng.below(6) {
                        0 => f32::NAN,
                        1 => -f32::NAN,
                        2 => -0.0,
                        3 => 0.0,
                        _ => rng.range(-1.0, 1.0),
                    })
                    .collect(),
            };
            if n > 3 && kind == 0 {
                l[1] = f32::NEG_INFINITY;
                l[n - 1] = f32::INFINITY;
            }
            let mut full: Vec<(u32, f32)> =
                l.iter().enumerate().map(|(i, &v)| (i as u32, v)).collect();
            full.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            for k in [0usize, 1, 2, 3, 40, n - 1, n, n + 5] {
                let got = top_candidates(&l, k);
                let want = if k > 0 && k < n {
                    &full[..k]
                } else {
                    &full[..]
                };
                let bits =
                    |v: &[(u32, f32)]| v.iter().map(|&(i, x)| (i, x.to_bits())).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(want), "n {n} kind {kind} k {k}");
            }
        }
    }

    #[test]
    fn greedy_and_seeded_sampling() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 100) as f32 / 10.0).collect();
        let mut g = Sampler::new(SamplerConfig {
            temp: 0.0,
            ..Default::default()
        });
        assert_eq!(g.sample(&logits, &[]), argmax(&logits));
        let run = |seed| {
            let mut s = Sampler::new(SamplerConfig {
                temp: 1.0,
                top_k: 0,
                top_p: 1.0,
                min_p: 0.0,
                seed,
                ..Default::default()
            });
            (0..50).map(|_| s.sample(&logits, &[])).collect::<Vec<_>>()
        };
        assert_eq!(run(1), run(1));
        assert_ne!(run(1), run(2));
        // top-k 1 is greedy whatever the temperature.
        let mut k1 = Sampler::new(SamplerConfig {
            temp: 5.0,
            top_k: 1,
            ..Default::default()
        });
        assert_eq!(k1.sample(&logits, &[]), argmax(&logits));
        // A strong repetition penalty moves greedy off the repeated token.
        let top = argmax(&logits);
        let mut p = Sampler::new(SamplerConfig {
            temp: 0.0,
            repeat_penalty: 100.0,
            ..Default::default()
        });
        assert_ne!(p.sample(&logits, &[top]), top);
        // min-p keeps only tokens near the top.
        let mut m = Sampler::new(SamplerConfig {
            temp: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.99,
            seed: 3,
            ..Default::default()
        });
        for _ in 0..20 {
            assert_eq!(m.sample(&logits, &[]), top);
        }
    }

    #[test]
    fn penalties_follow_llama_cpp_arithmetic() {
        let base = vec![2.0f32, -1.0, 0.5, 3.0, 0.0];
        // Token 0 twice, 1 once, 3 once but outside the window of 4.
        let history = [3, 0, 1, 0, 4];
        let mut l = base.clone();
        let p = Penalties {
            presence: 0.5,
            frequency: 0.25,
        };
        apply_penalties(&mut l, &history, 4, 2.0, p);
        assert_eq!(l[0], 2.0 / 2.0 - (2.0 * 0.25 + 0.5));
        assert_eq!(l[1], -2.0 - (0.25 + 0.5), "a negative logit is multiplied");
        assert_eq!(l[2], 0.5, "not in the window");
        assert_eq!(l[3], 3.0, "outside the last 4");
        assert_eq!(l[4], 0.0 * 2.0 - (0.25 + 0.5));
        // Presence and frequency alone (repeat 1), and negative ones.
        let alone = |presence, frequency| {
            let mut l = base.clone();
            apply_penalties(
                &mut l,
                &history,
                64,
                1.0,
                Penalties {
                    presence,
                    frequency,
                },
            );
            l
        };
        assert_eq!(alone(1.0, 0.0), vec![1.0, -2.0, 0.5, 2.0, -1.0]);
        assert_eq!(alone(0.0, 1.0), vec![0.0, -2.0, 0.5, 2.0, -1.0]);
        // Negative penalties raise the logits (OpenAI allows -2..2).
        let l = alone(-1.0, 0.0);
        assert_eq!(l[2], 0.5);
        assert_eq!(l[0], 3.0);
        // Nothing to do: untouched, bit for bit; window 0: untouched.
        for (n, r, p) in [(64, 1.0, Penalties::default()), (0, 2.0, p)] {
            let mut l = vec![-0.0f32, f32::NAN, 1.5];
            apply_penalties(&mut l, &[0, 1, 2], n, r, p);
            assert_eq!(l[0].to_bits(), (-0.0f32).to_bits());
            assert!(l[1].is_nan());
            assert_eq!(l[2], 1.5);
        }
        // Ids past the vocabulary are ignored.
        let mut l = base.clone();
        apply_penalties(&mut l, &[99], 64, 2.0, p);
        assert_eq!(l, base);
    }

    #[test]
    fn penalties_move_the_sampled_tokens() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 100) as f32 / 10.0).collect();
        let top = argmax(&logits);
        // Greedy with a presence penalty avoids a token already seen.
        let mut g = Sampler::new(SamplerConfig {
            temp: 0.0,
            ..Default::default()
        })
        .with_penalties(Penalties {
            presence: 2.0,
            frequency: 0.0,
        });
        assert_ne!(g.sample(&logits, &[top]), top);
        // Greedy generation with a frequency penalty never repeats a
        // token while the logits are this flat (0.1 apart).
        let mut f = Sampler::new(SamplerConfig {
            temp: 0.0,
            ..Default::default()
        })
        .with_penalties(Penalties {
            presence: 0.0,
            frequency: 2.0,
        });
        let mut hist = Vec::new();
        for _ in 0..10 {
            let t = f.sample(&logits, &hist);
            assert!(!hist.contains(&t));
            hist.push(t);
        }
        // Seeded sampling with penalties is deterministic, and differs from
        // sampling without them.
        let run = |p: Penalties| {
            let mut s = Sampler::new(SamplerConfig {
                temp: 1.0,
                top_k: 0,
                top_p: 1.0,
                min_p: 0.0,
                seed: 7,
                ..Default::default()
            })
            .with_penalties(p);
            let mut hist = Vec::new();
            for _ in 0..40 {
                let t = s.sample(&logits, &hist);
                hist.push(t);
            }
            hist
        };
        let p = Penalties {
            presence: 1.5,
            frequency: 1.5,
        };
        assert_eq!(run(p), run(p));
        assert_ne!(run(p), run(Penalties::default()));
    }

    #[test]
    fn logit_bias_moves_and_bans_tokens() {
        let logits: Vec<f32> = (0..100).map(|i| ((i * 37) % 100) as f32 / 10.0).collect();
        let top = argmax(&logits);
        let greedy = || {
            Sampler::new(SamplerConfig {
                temp: 0.0,
                ..Default::default()
            })
        };
        // -100 bans the top token; +100 makes token 5 the choice.
        let mut s = greedy().with_logit_bias(vec![(top, -100.0)]);
        assert_ne!(s.sample(&logits, &[]), top);
        let mut s = greedy().with_logit_bias(vec![(5, 100.0), (1000, 5.0)]);
        assert_eq!(s.sample(&logits, &[]), 5);
        // Applied before the penalties: the presence penalty lowers the
        // biased logit.
        let mut s = greedy()
            .with_logit_bias(vec![(5, 100.0)])
            .with_penalties(Penalties {
                presence: 200.0,
                frequency: 0.0,
            });
        assert_ne!(s.sample(&logits, &[5]), 5);
    }
}

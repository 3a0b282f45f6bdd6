//! Sampling: greedy, temperature, top-k, top-p, min-p and repetition penalty, in
//! llama.cpp's order (penalties, top-k, top-p, min-p, temperature), seeded so the
//! same seed gives the same tokens.

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

/// A sampler: settings plus its random stream.
pub struct Sampler {
    cfg: SamplerConfig,
    rng: Rng,
}

impl Sampler {
    /// A sampler with `cfg`.
    pub fn new(cfg: SamplerConfig) -> Self {
        let rng = Rng::new(cfg.seed);
        Sampler { cfg, rng }
    }

    /// Pick the next token from `logits`, given the tokens so far.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        let mut l = logits.to_vec();
        let c = &self.cfg;
        if c.repeat_penalty != 1.0 {
            let start = history.len().saturating_sub(c.repeat_last_n);
            let mut seen = std::collections::HashSet::new();
            for &t in &history[start..] {
                if (t as usize) < l.len() && seen.insert(t) {
                    let v = &mut l[t as usize];
                    *v = if *v > 0.0 {
                        *v / c.repeat_penalty
                    } else {
                        *v * c.repeat_penalty
                    };
                }
            }
        }
        if c.temp <= 0.0 {
            return argmax(&l);
        }
        // Candidates sorted by logit, highest first; ties by lower id.
        let mut cand: Vec<(u32, f32)> = l.iter().enumerate().map(|(i, &v)| (i as u32, v)).collect();
        cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        if c.top_k > 0 && c.top_k < cand.len() {
            cand.truncate(c.top_k);
        }
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

/// Index of the largest logit (lowest index among equals).
pub fn argmax(l: &[f32]) -> u32 {
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
}

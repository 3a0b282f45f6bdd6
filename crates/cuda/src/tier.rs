//! Tier mode's host-side plan: which weights stay in VRAM (the
//! trunk: attention / delta-net weights, norms, routers, shared experts,
//! embeddings, head), how many routed-expert slots per layer the VRAM budget
//! leaves after the trunk, the KV/activation reserve and the two prefill
//! staging slots, and the decode cache's replacement policy (least recently
//! used, never evicting an expert the same step needs).
//!
//! Everything here is plain host logic, so it is tested without a GPU. The
//! slot an expert lands in never changes what is computed (the kernels read
//! the same bytes through a slot table), so the policy is free to be anything
//! deterministic; LRU is the seeds' choice.

use crate::{CudaError, Result};
use samesum_engine::Model;
use samesum_engine::model::weights::Matrix;

/// VRAM a tier plan keeps free for the KV cache, activations and scratch.
pub const RESERVE: u64 = 1 << 30;

/// Bytes of one matrix (all its stacked matrices).
fn matrix_bytes(m: &Matrix) -> u64 {
    (m.rows * m.row_bytes * m.n_mats) as u64
}

/// Bytes of one stacked matrix (one expert's).
fn one_bytes(m: &Matrix) -> u64 {
    (m.rows * m.row_bytes) as u64
}

/// Sizes that decide a tier plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TierSizes {
    /// What stays in VRAM: everything but the routed experts and `host`, in
    /// bytes (file metadata included, a slight overestimate).
    pub trunk: u64,
    /// The token embedding when only the embedding reads it: the CUDA
    /// backend dequantizes those rows on the host, so it needs no VRAM.
    pub host: u64,
    /// One routed expert of one layer (gate + up + down), in bytes.
    pub expert: u64,
    /// Routed experts per layer.
    pub experts: usize,
    /// Experts each token routes to.
    pub used: usize,
    /// Layers (each has routed experts).
    pub layers: usize,
}

impl TierSizes {
    /// The sizes of `model`: the routed expert stacks against everything else
    /// in its file (tensor data; metadata excluded).
    pub fn of(model: &Model) -> TierSizes {
        let w = &model.w;
        let mut routed = 0u64;
        let mut expert = 0u64;
        for l in &w.layers {
            let m = &l.moe;
            routed += matrix_bytes(&m.gate) + matrix_bytes(&m.up) + matrix_bytes(&m.down);
            expert = expert.max(one_bytes(&m.gate) + one_bytes(&m.up) + one_bytes(&m.down));
        }
        let total = model.bytes().len() as u64;
        let host = if w.output.offset == w.token_embd.offset {
            0
        } else {
            matrix_bytes(&w.token_embd)
        };
        TierSizes {
            trunk: total.saturating_sub(routed + host),
            host,
            expert,
            experts: model.hp.n_expert,
            used: model.hp.n_expert_used,
            layers: w.layers.len(),
        }
    }

    /// All routed experts of one layer, in bytes (one prefill staging slot).
    pub fn layer_experts(&self) -> u64 {
        self.expert * self.experts as u64
    }

    /// The whole model, in bytes.
    pub fn total(&self) -> u64 {
        self.trunk + self.host + self.layer_experts() * self.layers as u64
    }
}

/// How a model is placed under a VRAM budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TierPlan {
    /// The sizes the plan was made from.
    pub sizes: TierSizes,
    /// Decode cache slots per layer (at least `used`, at most `experts`).
    pub slots: usize,
    /// Bytes of the two prefill staging slots (each one layer's experts).
    pub staging: u64,
    /// Bytes the plan puts in VRAM: trunk + staging + slots.
    pub vram: u64,
}

/// Plan `sizes` into `budget` bytes of VRAM, keeping `reserve` bytes for the
/// KV cache, activations and scratch. Fails, naming every size, when the
/// trunk, the reserve, the two staging slots and one token's experts per
/// layer do not fit.
pub fn plan(sizes: TierSizes, budget: u64, reserve: u64) -> Result<TierPlan> {
    let staging = 2 * sizes.layer_experts();
    let per_slot = sizes.expert * sizes.layers as u64;
    let fixed = sizes.trunk + reserve + staging;
    let least = fixed + per_slot * sizes.used as u64;
    if budget < least || per_slot == 0 {
        return Err(CudaError::Budget {
            budget_mib: budget >> 20,
            trunk_mib: sizes.trunk >> 20,
            reserve_mib: reserve >> 20,
            staging_mib: staging >> 20,
            slots_mib: (per_slot * sizes.used as u64) >> 20,
            used: sizes.used,
        });
    }
    let slots = (((budget - fixed) / per_slot) as usize).min(sizes.experts);
    Ok(TierPlan {
        sizes,
        slots,
        staging,
        vram: fixed - reserve + per_slot * slots as u64,
    })
}

/// Parse a byte count: a plain number, or one with a binary suffix
/// (`K`, `M`, `G`, `T`, each optionally followed by `B` or `iB`; `24G` =
/// 24 GiB). Decimals are allowed with a suffix (`1.5G`).
pub fn parse_bytes(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let digits = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(digits);
    let shift = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 0,
        "K" | "KB" | "KIB" => 10,
        "M" | "MB" | "MIB" => 20,
        "G" | "GB" | "GIB" => 30,
        "T" | "TB" | "TIB" => 40,
        _ => return Err(format!("{s:?}: unknown unit {unit:?} (use K, M, G or T)")),
    };
    if num.is_empty() {
        return Err(format!("{s:?}: no number"));
    }
    if shift == 0 {
        return num
            .parse::<u64>()
            .map_err(|_| format!("{s:?}: not a whole number of bytes"));
    }
    let v: f64 = num
        .parse()
        .map_err(|_| format!("{s:?}: {num:?} is not a number"))?;
    let bytes = v * (1u64 << shift) as f64;
    if !bytes.is_finite() || bytes >= u64::MAX as f64 {
        return Err(format!("{s:?}: too large"));
    }
    Ok(bytes as u64)
}

/// A fetch the decode step must issue before its experts run: copy `expert`
/// of the layer from host memory into `slot`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fetch {
    /// Expert id.
    pub expert: u32,
    /// Destination slot.
    pub slot: u32,
}

#[derive(Clone, Debug)]
struct LayerSlots {
    /// Per expert: its slot, or -1.
    slot_of: Vec<i32>,
    /// Per slot: its expert, or -1.
    expert_in: Vec<i32>,
    /// Per slot: the step that last used it (0 = never).
    last: Vec<u64>,
}

/// The decode cache's bookkeeping: per layer, which expert sits in which VRAM
/// slot, least-recently-used replacement, hit and miss counts.
#[derive(Clone, Debug)]
pub struct ExpertCache {
    layers: Vec<LayerSlots>,
    step: u64,
    /// Experts found resident.
    pub hits: u64,
    /// Experts fetched.
    pub misses: u64,
}

impl ExpertCache {
    /// An empty cache of `slots` slots per layer.
    pub fn new(layers: usize, experts: usize, slots: usize) -> ExpertCache {
        let one = LayerSlots {
            slot_of: vec![-1; experts],
            expert_in: vec![-1; slots],
            last: vec![0; slots],
        };
        ExpertCache {
            layers: vec![one; layers],
            step: 0,
            hits: 0,
            misses: 0,
        }
    }

    /// Hit rate so far (0 when nothing was looked up).
    pub fn hit_rate(&self) -> f64 {
        samesum_engine::backend::OffloadCounters {
            hits: self.hits,
            misses: self.misses,
            ..Default::default()
        }
        .hit_rate()
    }

    /// Make the experts one step routes to in `layer` resident: `ids` are the
    /// step's expert ids (negative = skipped). Returns each id's slot (-1 for
    /// skipped ids) and the fetches to issue; a miss takes an empty slot or
    /// evicts the least recently used expert that this step does not need
    /// (lowest slot first among equals).
    pub fn route(&mut self, layer: usize, ids: &[i32]) -> Result<(Vec<i32>, Vec<Fetch>)> {
        self.step += 1;
        let step = self.step;
        let l = self
            .layers
            .get_mut(layer)
            .ok_or_else(|| CudaError::Driver {
                op: "expert cache".into(),
                msg: format!("layer {layer} out of range"),
            })?;
        let distinct = {
            let mut v: Vec<i32> = ids.iter().copied().filter(|&e| e >= 0).collect();
            v.sort_unstable();
            v.dedup();
            v
        };
        if distinct.len() > l.expert_in.len() {
            return Err(CudaError::Driver {
                op: "expert cache".into(),
                msg: format!(
                    "a step needs {} experts in layer {layer} but the layer has {} slots",
                    distinct.len(),
                    l.expert_in.len()
                ),
            });
        }
        if let Some(&e) = distinct.iter().find(|&&e| e as usize >= l.slot_of.len()) {
            return Err(CudaError::Driver {
                op: "expert cache".into(),
                msg: format!("expert {e} out of range ({} experts)", l.slot_of.len()),
            });
        }
        // Hits first, so that misses never evict an expert of this step.
        for &e in &distinct {
            let s = l.slot_of[e as usize];
            if s >= 0 {
                l.last[s as usize] = step;
                self.hits += 1;
            }
        }
        let mut fetches = Vec::new();
        for &e in &distinct {
            if l.slot_of[e as usize] >= 0 {
                continue;
            }
            let victim = (0..l.expert_in.len())
                .filter(|&s| l.last[s] != step)
                .min_by_key(|&s| (l.expert_in[s] >= 0, l.last[s], s))
                .expect("enough slots: checked above");
            let old = l.expert_in[victim];
            if old >= 0 {
                l.slot_of[old as usize] = -1;
            }
            l.expert_in[victim] = e;
            l.slot_of[e as usize] = victim as i32;
            l.last[victim] = step;
            self.misses += 1;
            fetches.push(Fetch {
                expert: e as u32,
                slot: victim as u32,
            });
        }
        let slots = ids
            .iter()
            .map(|&e| if e < 0 { -1 } else { l.slot_of[e as usize] })
            .collect();
        Ok((slots, fetches))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_counts_parse_with_binary_units_and_bad_ones_are_errors() {
        assert_eq!(parse_bytes("1024"), Ok(1024));
        assert_eq!(parse_bytes("24G"), Ok(24 << 30));
        assert_eq!(parse_bytes("24GiB"), Ok(24 << 30));
        assert_eq!(parse_bytes("12gb"), Ok(12 << 30));
        assert_eq!(parse_bytes("512M"), Ok(512 << 20));
        assert_eq!(parse_bytes("1.5G"), Ok(3 << 29));
        assert_eq!(parse_bytes(" 40000000000 "), Ok(40_000_000_000));
        for bad in ["", "G", "12X", "1.5", "-3G", "1e9", "99999999999999999999T"] {
            assert!(parse_bytes(bad).is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn sizes_split_a_model_into_trunk_and_routed_experts() {
        use samesum_synth::{SynthOptions, shapes, write_model};
        for shape in ["tiny-qwen3moe", "tiny-qwen35moe"] {
            let dir = tempfile::tempdir().unwrap();
            let p = dir.path().join("m.gguf");
            let opts = SynthOptions::new(
                shapes::by_name(shape).unwrap(),
                samesum_gguf::GgmlType::Q4_K,
                1,
            );
            write_model(&opts, &p, &mut |_, _| {}).unwrap();
            let model = Model::load(&p).unwrap();
            let s = TierSizes::of(&model);
            let file = std::fs::metadata(&p).unwrap().len();
            assert_eq!(
                s.total(),
                file,
                "{shape}: trunk + embedding + experts = the file"
            );
            assert_eq!(
                s.host,
                matrix_bytes(&model.w.token_embd),
                "{shape}: untied embedding"
            );
            let moe = &model.w.layers[0].moe;
            let routed: u64 = model
                .w
                .layers
                .iter()
                .map(|l| {
                    matrix_bytes(&l.moe.gate) + matrix_bytes(&l.moe.up) + matrix_bytes(&l.moe.down)
                })
                .sum();
            assert_eq!(routed, s.expert * (s.experts * s.layers) as u64);
            assert_eq!(s.expert, (moe.gate.rows * moe.gate.row_bytes * 3) as u64);
            assert!(s.trunk > 0 && s.trunk < file);
            assert_eq!(
                (s.experts, s.used),
                (model.hp.n_expert, model.hp.n_expert_used)
            );
        }
    }

    fn sizes() -> TierSizes {
        // Roughly qwen35moe-35b-a3b q4_k: 256 experts of 1.77 MB, 40 layers.
        TierSizes {
            trunk: 700 << 20,
            host: 0,
            expert: 3 * 2048 * 512 * 144 / 256,
            experts: 256,
            used: 8,
            layers: 40,
        }
    }

    #[test]
    fn a_plan_fills_the_budget_with_slots_and_names_the_sizes_when_it_cannot() {
        let s = sizes();
        let p = plan(s, 12 << 30, 1 << 30).unwrap();
        assert!(p.slots >= s.used && p.slots < s.experts, "{p:?}");
        assert!(p.vram + (1 << 30) <= 12 << 30);
        // One more slot per layer would not fit.
        assert!(p.vram + (1 << 30) + s.expert * s.layers as u64 > 12 << 30);
        // A budget above the whole model gives every expert a slot.
        let all = plan(s, s.total() + (8 << 30), 1 << 30).unwrap();
        assert_eq!(all.slots, s.experts);
        // Too small for the trunk: an error naming the sizes.
        let e = plan(s, 512 << 20, 1 << 30).unwrap_err().to_string();
        for part in ["512 MiB", "700 MiB", "1024 MiB", "trunk"] {
            assert!(e.contains(part), "{e}");
        }
        // Room for the trunk but not for one token's experts in every layer.
        let tight = s.trunk + (1 << 30) + 2 * s.layer_experts() + 7 * s.expert * 40;
        assert!(plan(s, tight, 1 << 30).is_err());
        assert!(plan(s, tight + s.expert * 40, 1 << 30).is_ok());
    }

    #[test]
    fn misses_fill_empty_slots_then_evict_the_least_recently_used() {
        let mut c = ExpertCache::new(1, 10, 3);
        let (s, f) = c.route(0, &[1, 2, 3]).unwrap();
        assert_eq!(s, vec![0, 1, 2]);
        assert_eq!(f.len(), 3);
        assert_eq!((c.hits, c.misses), (0, 3));
        // 1 is used again, so 2 is now the least recently used.
        let (_, f) = c.route(0, &[1]).unwrap();
        assert!(f.is_empty());
        let (s, f) = c.route(0, &[4, -1]).unwrap();
        assert_eq!(f, vec![Fetch { expert: 4, slot: 1 }]);
        assert_eq!(s, vec![1, -1]);
        assert_eq!((c.hits, c.misses), (1, 4));
        // A step never evicts its own experts: 3 is older than 1 and 4, but
        // needed now, so 5 takes 1's slot (the older of the other two).
        let (s, f) = c.route(0, &[3, 5]).unwrap();
        assert_eq!(s, vec![2, 0]);
        assert_eq!(f, vec![Fetch { expert: 5, slot: 0 }]);
        // More distinct experts than slots, or an id out of range: errors.
        assert!(c.route(0, &[6, 7, 8, 9]).is_err());
        assert!(c.route(0, &[10]).is_err());
        assert!(c.route(1, &[0]).is_err());
    }

    /// Against a reference written the other way round (per resident expert:
    /// its slot and last step; free slots lowest first) on random skewed
    /// routings: the same slots, hits and misses; every returned slot holds
    /// its expert; no slot holds two experts.
    #[test]
    fn the_cache_agrees_with_a_reference_lru_on_random_routings() {
        use std::collections::BTreeMap;
        let mut rng = samesum_quant::rng::Rng::new(9);
        for &(experts, slots, k) in &[(16usize, 4usize, 2usize), (64, 16, 8), (128, 40, 8)] {
            let mut c = ExpertCache::new(2, experts, slots);
            // Per layer: expert -> (slot, last step).
            let mut refs: Vec<BTreeMap<i32, (usize, u64)>> = vec![BTreeMap::new(); 2];
            let (mut hits, mut misses) = (0u64, 0u64);
            for step in 1..=3000u64 {
                let layer = (rng.next_u64() % 2) as usize;
                // Skewed routing: low ids more often, as real routers are.
                let mut ids: Vec<i32> = Vec::new();
                while ids.len() < k {
                    let a = rng.below(experts as u64);
                    let e = a.min(rng.below(experts as u64)) as i32;
                    if !ids.contains(&e) {
                        ids.push(e);
                    }
                }
                let (got, _) = c.route(layer, &ids).unwrap();
                let r = &mut refs[layer];
                let mut sorted = ids.clone();
                sorted.sort_unstable();
                for &e in &sorted {
                    if let Some(v) = r.get_mut(&e) {
                        v.1 = step;
                        hits += 1;
                    }
                }
                for &e in &sorted {
                    if r.contains_key(&e) {
                        continue;
                    }
                    misses += 1;
                    let used: Vec<usize> = r.values().map(|v| v.0).collect();
                    let slot = match (0..slots).find(|s| !used.contains(s)) {
                        Some(s) => s,
                        None => {
                            let (&old, &(s, _)) = r
                                .iter()
                                .filter(|(_, v)| v.1 != step)
                                .min_by_key(|(_, v)| (v.1, v.0))
                                .unwrap();
                            r.remove(&old);
                            s
                        }
                    };
                    r.insert(e, (slot, step));
                }
                for (i, &e) in ids.iter().enumerate() {
                    assert_eq!(got[i] as usize, r[&e].0, "step {step}: slot of {e}");
                }
                let l = &c.layers[layer];
                for (i, &e) in ids.iter().enumerate() {
                    assert_eq!(l.expert_in[got[i] as usize], e);
                }
                let mut held: Vec<i32> = l.expert_in.iter().copied().filter(|&e| e >= 0).collect();
                held.sort_unstable();
                let n = held.len();
                held.dedup();
                assert_eq!(held.len(), n, "an expert in two slots");
            }
            assert_eq!((c.hits, c.misses), (hits, misses), "{experts}/{slots}/{k}");
            assert!(c.hit_rate() > 0.0 && c.hit_rate() < 1.0);
        }
    }
}

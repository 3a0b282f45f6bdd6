//! Expert parallelism with simulated ranks on the CPU: every rank's buffers
//! are separate vectors, the all-to-alls are copies between them in the
//! exchange's order, and each rank runs only its own experts over the rows it
//! received. The output must equal one device's MoE byte for byte.

use super::{Exchange, Placement, block_owners};
use crate::cpu::Cpu;
use crate::cpu_backend::tests::model_in as model;
use crate::cpu_backend::{moe as one_device_moe, moe_combine, moe_experts, moe_route};
use crate::model::Model;
use crate::model::weights::MoeW;
use samesum_gguf::GgmlType;

/// What the run moved and computed, for the checks beside the bytes.
struct Traffic {
    /// Rows each rank's experts computed.
    computed: Vec<usize>,
    /// Rows sent between distinct ranks (each way).
    remote: usize,
}

/// One MoE call over `x` with tokens owned by `owner` and the experts split
/// by `placement`: each owner routes its rows and runs the shared expert,
/// the rows go to their experts' ranks, the results come back, and each
/// owner combines its tokens. `reversed` combines with the negative control's
/// order (to show the comparison can fail).
fn moe_on_ranks(
    model: &Model,
    cpu: &Cpu,
    mw: &MoeW,
    x: &[f32],
    owner: &[u32],
    placement: &Placement,
    reversed: bool,
) -> (Vec<f32>, Traffic) {
    let (d, k) = (model.hp.n_embd, model.hp.n_expert_used);
    let ranks = placement.ranks();
    let m = x.len() / d;
    // Each rank's own tokens, in token order, and where each sits there.
    let mine: Vec<Vec<usize>> = (0..ranks)
        .map(|r| (0..m).filter(|&t| owner[t] as usize == r).collect())
        .collect();
    let mut local_row = vec![0usize; m];
    for toks in &mine {
        for (i, &t) in toks.iter().enumerate() {
            local_row[t] = i;
        }
    }
    let xr: Vec<Vec<f32>> = mine
        .iter()
        .map(|toks| {
            toks.iter()
                .flat_map(|&t| x[t * d..(t + 1) * d].iter().copied())
                .collect()
        })
        .collect();
    // Routing and the shared expert on the owners.
    let routed: Vec<(Vec<i32>, Vec<f32>)> =
        xr.iter().map(|xs| moe_route(model, cpu, mw, xs)).collect();
    let shared: Vec<_> = xr
        .iter()
        .map(|xs| moe_experts(model, cpu, mw, xs, &[], k, true).1)
        .collect();
    // The global routing the exchange is planned from.
    let mut ids = vec![-1i32; m * k];
    for (t, &o) in owner.iter().enumerate() {
        let li = local_row[t];
        ids[t * k..(t + 1) * k].copy_from_slice(&routed[o as usize].0[li * k..(li + 1) * k]);
    }
    let ex = Exchange::build(&ids, k, owner, placement).unwrap();
    // All-to-all: each source packs its send buffers in the exchange's order.
    let send: Vec<Vec<Vec<f32>>> = (0..ranks)
        .map(|s| {
            (0..ranks)
                .map(|dst| {
                    ex.pairs(s, dst)
                        .iter()
                        .flat_map(|&p| {
                            let lr = local_row[ex.token(p)];
                            xr[s][lr * d..(lr + 1) * d].iter().copied()
                        })
                        .collect()
                })
                .collect()
        })
        .collect();
    let mut traffic = Traffic {
        computed: vec![0; ranks],
        remote: 0,
    };
    // Each destination: the received rows (sources in rank order), its own
    // experts over them, the results split back per source.
    let mut back: Vec<Vec<Vec<f32>>> = vec![vec![Vec::new(); ranks]; ranks];
    for dst in 0..ranks {
        let recv: Vec<f32> = (0..ranks)
            .flat_map(|s| send[s][dst].iter().copied())
            .collect();
        let rec = ex.received(dst);
        let local_ids: Vec<i32> = rec.iter().map(|&(_, _, e)| e as i32).collect();
        assert!(
            local_ids
                .iter()
                .all(|&e| placement.experts(dst).contains(&(e as usize)))
        );
        let (out, _) = moe_experts(model, cpu, mw, &recv, &local_ids, 1, false);
        traffic.computed[dst] = rec.len();
        let mut at = 0;
        for (s, b) in back.iter_mut().enumerate() {
            let n = ex.pairs(s, dst).len();
            b[dst] = out[at * d..(at + n) * d].to_vec();
            at += n;
            if s != dst {
                traffic.remote += n;
            }
        }
    }
    // Each owner scatters the returned rows by pair and combines.
    let mut y = vec![f32::NAN; m * d];
    for s in 0..ranks {
        let n = mine[s].len();
        let mut pair_out = vec![0f32; n * k * d];
        for (dst, rows) in back[s].iter().enumerate() {
            for (&p, row) in ex.pairs(s, dst).iter().zip(rows.chunks_exact(d)) {
                let (t, slot) = (ex.token(p), p as usize % k);
                let lp = local_row[t] * k + slot;
                pair_out[lp * d..(lp + 1) * d].copy_from_slice(row);
            }
        }
        let mut ys = vec![f32::NAN; n * d];
        let (rid, rw) = &routed[s];
        moe_combine(
            model,
            rid,
            rw,
            &pair_out,
            shared[s].as_ref(),
            reversed,
            &mut ys,
        );
        for (i, &t) in mine[s].iter().enumerate() {
            y[t * d..(t + 1) * d].copy_from_slice(&ys[i * d..(i + 1) * d]);
        }
    }
    (y, traffic)
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn rows(m: usize, d: usize, seed: u64) -> Vec<f32> {
    let mut s = seed | 1;
    (0..m * d)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0
        })
        .collect()
}

/// One to four simulated ranks, tokens owned in blocks, round robin or all
/// by one rank: the first two MoE layers' outputs equal one device's byte for
/// byte, on every tiny architecture in two weight formats, for 1 to 64 rows;
/// every routed pair is computed once, on the rank holding its expert.
#[test]
fn expert_parallel_moe_equals_one_device() {
    let cpu = Cpu::new(2);
    for shape in ["tiny-qwen3moe", "tiny-qwen3next", "tiny-qwen35moe"] {
        for quant in [GgmlType::Q8_0, GgmlType::Q4_K] {
            let (_dir, m) = model(shape, quant);
            let (d, k) = (m.hp.n_embd, m.hp.n_expert_used);
            for (l, layer) in m.w.layers.iter().enumerate().take(2) {
                let mw = &layer.moe;
                for n in [1usize, 3, 17, 64] {
                    let x = rows(n, d, (l * 1000 + n) as u64 ^ 0x5eed);
                    let mut want = vec![f32::NAN; n * d];
                    one_device_moe(&m, &cpu, mw, &x, &mut want);
                    for ranks in 1..=4 {
                        let placement = Placement::even(m.hp.n_expert, ranks).unwrap();
                        let owners = [
                            block_owners(n, ranks),
                            (0..n).map(|t| (t % ranks) as u32).collect(),
                            vec![(ranks - 1) as u32; n],
                        ];
                        for owner in &owners {
                            let (got, traffic) =
                                moe_on_ranks(&m, &cpu, mw, &x, owner, &placement, false);
                            assert_eq!(
                                bits(&got),
                                bits(&want),
                                "{shape} {quant:?} layer {l}, {n} rows, {ranks} ranks, owners {owner:?}"
                            );
                            assert_eq!(traffic.computed.iter().sum::<usize>(), n * k);
                            if ranks == 1 {
                                assert_eq!(traffic.remote, 0);
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The comparison above can fail: the same exchange combined in the negative
/// control's order (slots backwards, fused multiply-adds) differs.
#[test]
fn a_reordered_combine_on_ranks_is_caught() {
    let cpu = Cpu::new(2);
    let (_dir, m) = model("tiny-qwen3moe", GgmlType::Q8_0);
    let d = m.hp.n_embd;
    let mw = &m.w.layers[0].moe;
    let n = 64;
    let x = rows(n, d, 77);
    let mut want = vec![f32::NAN; n * d];
    one_device_moe(&m, &cpu, mw, &x, &mut want);
    let placement = Placement::even(m.hp.n_expert, 2).unwrap();
    let (got, traffic) = moe_on_ranks(&m, &cpu, mw, &x, &block_owners(n, 2), &placement, true);
    assert!(traffic.remote > 0);
    assert_ne!(bits(&got), bits(&want));
}

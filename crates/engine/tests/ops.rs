//! The CPU backend's row kernels under the row contract: for every row op,
//! one m-row call equals m one-row calls byte for byte (sequential ops
//! carrying their state from row to row), for m in {1, 2, 3, 5, 16, 17, 64,
//! 100, 257}, on fresh random inputs, into output buffers poisoned with NaN,
//! with 1 and 3 threads. The block ops behind the `Backend` interface are
//! checked by the conformance bodies (tests/conformance.rs).

use samesum_engine::cpu::{self, AttnParams, Cpu, DeltaParams};
use samesum_engine::model::Matrix;
use samesum_engine::model::{Rope, RopeScaling};
use samesum_engine::state::{KvLayer, KvType, SeqState};
use samesum_gguf::GgmlType;
use samesum_quant::rng::Rng;
use samesum_quant::testing::random_weight_blocks;

const MS: &[usize] = &[1, 2, 3, 5, 16, 17, 64, 100, 257];

fn rand_vec(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.range(-scale, scale)).collect()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

fn poisoned(n: usize) -> Vec<f32> {
    vec![f32::NAN; n]
}

#[test]
fn matmul_rows() {
    let mut rng = Rng::new(1);
    for (ty, cols, rows) in [
        (GgmlType::Q4_K, 512, 37),
        (GgmlType::Q6_K, 256, 20),
        (GgmlType::Q8_0, 96, 33),
        (GgmlType::Q4_0, 64, 17),
        (GgmlType::BF16, 200, 40),
        (GgmlType::F32, 130, 9),
    ] {
        let bytes = random_weight_blocks(ty, cols * rows / ty.block_size(), &mut rng).unwrap();
        let w = Matrix {
            name: "w".into(),
            ty,
            cols,
            rows,
            n_mats: 1,
            offset: 0,
            row_bytes: bytes.len() / rows,
        };
        for &m in MS {
            let x = rand_vec(&mut rng, m * cols, 1.0);
            let mut reference = poisoned(m * rows);
            Cpu::new(1).matmul(&bytes, &w, 0, &x, &mut reference);
            assert!(
                reference.iter().all(|v| v.is_finite()),
                "{ty} m={m}: output not fully written"
            );
            for threads in [1, 3] {
                let c = Cpu::new(threads);
                let mut all = poisoned(m * rows);
                c.matmul(&bytes, &w, 0, &x, &mut all);
                assert_eq!(bits(&all), bits(&reference), "{ty} m={m} threads={threads}");
                for r in [0, m / 2, m - 1] {
                    let mut one = poisoned(rows);
                    c.matmul(&bytes, &w, 0, &x[r * cols..(r + 1) * cols], &mut one);
                    assert_eq!(
                        bits(&one),
                        bits(&all[r * rows..(r + 1) * rows]),
                        "{ty} m={m} row {r}"
                    );
                }
            }
        }
    }
}

#[test]
fn rms_norm_and_rope_rows() {
    let mut rng = Rng::new(2);
    let dim = 96;
    let w = rand_vec(&mut rng, dim, 2.0);
    for &m in MS {
        let x = rand_vec(&mut rng, m * dim, 3.0);
        let mut all = poisoned(m * dim);
        cpu::rms_norm(&x, &w, 1e-6, &mut all);
        for r in 0..m {
            let mut one = poisoned(dim);
            cpu::rms_norm(&x[r * dim..(r + 1) * dim], &w, 1e-6, &mut one);
            assert_eq!(
                bits(&one),
                bits(&all[r * dim..(r + 1) * dim]),
                "rms_norm m={m} row {r}"
            );
        }
        // RoPE of a row depends only on the row and its position (plain and
        // YaRN-scaled).
        let yarn = RopeScaling::Yarn {
            factor: 4.0,
            orig_ctx: 512,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attn_factor: 1.0,
            yarn_attn: None,
        };
        for rope in [
            Rope::new(16, 1e6, RopeScaling::None),
            Rope::new(16, 1e6, yarn),
        ] {
            let mut a = x.clone();
            for r in 0..m {
                cpu::rope_row(&mut a[r * dim..(r + 1) * dim], 32, &rope, 1000 + r);
            }
            let r = m - 1;
            let mut one = x[r * dim..(r + 1) * dim].to_vec();
            cpu::rope_row(&mut one, 32, &rope, 1000 + r);
            assert_eq!(bits(&one), bits(&a[r * dim..(r + 1) * dim]));
        }
    }
}

#[test]
fn router_rows() {
    let mut rng = Rng::new(3);
    let e = 32;
    for &m in MS {
        let logits = rand_vec(&mut rng, m * e, 4.0);
        for r in 0..m {
            let mut a = logits[r * e..(r + 1) * e].to_vec();
            let mut b = a.clone();
            assert_eq!(cpu::route(&mut a, 4), cpu::route(&mut b, 4));
        }
    }
    // Ties go to the lowest id; weights sum to 1 in k order.
    let mut tied = vec![1.0f32, 3.0, 3.0, 0.5, 3.0];
    let (ids, w) = cpu::route(&mut tied, 2);
    assert_eq!(ids, vec![1, 2]);
    assert_eq!(w, vec![0.5, 0.5]);
}

fn attn_case(m: usize, threads: usize, kv: KvType, rng: &mut Rng) {
    let p = AttnParams {
        n_head: 4,
        n_head_kv: 2,
        head_dim: 32,
        rope: Rope::new(16, 1e7, RopeScaling::None),
    };
    let (qw, kvw) = (p.n_head * p.head_dim, p.n_head_kv * p.head_dim);
    let ctx = 300;
    let q = rand_vec(rng, m * qw, 1.0);
    let k = rand_vec(rng, m * kvw, 1.0);
    let v = rand_vec(rng, m * kvw, 1.0);
    let hp = tiny_hp();
    let fresh = || match SeqState::new(&hp, ctx, kv).kv.remove(0) {
        Some(c) => c,
        None => unreachable!(),
    };
    let c = Cpu::new(threads);
    let mut cache_all: KvLayer = fresh();
    let mut o_all = poisoned(m * qw);
    c.attention_rows(
        &mut q.clone(),
        &mut k.clone(),
        &v,
        &mut cache_all,
        3,
        &p,
        &mut o_all,
    );
    let mut cache_one: KvLayer = fresh();
    for r in 0..m {
        let mut o = poisoned(qw);
        c.attention_rows(
            &mut q[r * qw..(r + 1) * qw].to_vec(),
            &mut k[r * kvw..(r + 1) * kvw].to_vec(),
            &v[r * kvw..(r + 1) * kvw],
            &mut cache_one,
            3 + r,
            &p,
            &mut o,
        );
        assert_eq!(
            bits(&o),
            bits(&o_all[r * qw..(r + 1) * qw]),
            "attention m={m} t={threads} row {r}"
        );
    }
    for pos in 3..3 + m {
        for i in 0..kvw {
            assert_eq!(
                cache_one.k_at(pos, kvw, i).to_bits(),
                cache_all.k_at(pos, kvw, i).to_bits()
            );
            assert_eq!(
                cache_one.v_at(pos, kvw, i).to_bits(),
                cache_all.v_at(pos, kvw, i).to_bits()
            );
        }
    }
}

fn tiny_hp() -> samesum_engine::HParams {
    samesum_engine::HParams {
        arch: samesum_engine::Arch::Qwen3Moe,
        n_layer: 1,
        n_embd: 128,
        n_head: 4,
        n_head_kv: 2,
        head_dim: 32,
        n_rot: 16,
        rope_theta: 1e7,
        rope_scaling: RopeScaling::None,
        eps: 1e-6,
        n_ctx_train: 4096,
        n_expert: 4,
        n_expert_used: 2,
        n_ff_exp: 32,
        n_ff_shexp: 0,
        ssm: None,
        layers: vec![samesum_engine::model::LayerKind::Attention],
    }
}

#[test]
fn attention_rows_with_cache() {
    let mut rng = Rng::new(4);
    for &m in MS {
        for threads in [1, 3] {
            attn_case(m, threads, KvType::F32, &mut rng);
        }
    }
    attn_case(17, 2, KvType::F16, &mut rng);
    attn_case(17, 2, KvType::BF16, &mut rng);
}

#[test]
fn conv_and_delta_rows_with_state() {
    let mut rng = Rng::new(5);
    for tiled in [false, true] {
        let p = DeltaParams {
            n_k_heads: 2,
            n_v_heads: 4,
            head_k_dim: 16,
            head_v_dim: 16,
            tiled,
            eps: 1e-6,
        };
        let (kd, vd) = (2 * 16, 4 * 16);
        let cd = 2 * kd + vd;
        let kc = 4;
        let taps = rand_vec(&mut rng, cd * kc, 0.5);
        let dt = rand_vec(&mut rng, 4, 1.0);
        let ssm_a: Vec<f32> = (0..4).map(|_| -rng.range(1.0, 16.0)).collect();
        let norm = rand_vec(&mut rng, 16, 2.0);
        for &m in MS {
            let x = rand_vec(&mut rng, m * cd, 1.0);
            let b = rand_vec(&mut rng, m * 4, 2.0);
            let a = rand_vec(&mut rng, m * 4, 2.0);
            let z = rand_vec(&mut rng, m * vd, 2.0);
            let conv_state0 = rand_vec(&mut rng, (kc - 1) * cd, 1.0);
            let s0 = rand_vec(&mut rng, 4 * 16 * 16, 0.1);
            for threads in [1, 3] {
                let c = Cpu::new(threads);
                let (mut cs_all, mut s_all) = (conv_state0.clone(), s0.clone());
                let mut conv_all = poisoned(m * cd);
                cpu::conv_rows(&x, &taps, kc, &mut cs_all, &mut conv_all);
                let mut o_all = poisoned(m * vd);
                c.delta_rows(
                    &conv_all, &b, &a, &z, &dt, &ssm_a, &norm, &p, &mut s_all, &mut o_all,
                );
                let (mut cs, mut s) = (conv_state0.clone(), s0.clone());
                for r in 0..m {
                    let mut conv = poisoned(cd);
                    cpu::conv_rows(&x[r * cd..(r + 1) * cd], &taps, kc, &mut cs, &mut conv);
                    assert_eq!(
                        bits(&conv),
                        bits(&conv_all[r * cd..(r + 1) * cd]),
                        "conv m={m} row {r}"
                    );
                    let mut o = poisoned(vd);
                    c.delta_rows(
                        &conv,
                        &b[r * 4..(r + 1) * 4],
                        &a[r * 4..(r + 1) * 4],
                        &z[r * vd..(r + 1) * vd],
                        &dt,
                        &ssm_a,
                        &norm,
                        &p,
                        &mut s,
                        &mut o,
                    );
                    assert_eq!(
                        bits(&o),
                        bits(&o_all[r * vd..(r + 1) * vd]),
                        "delta m={m} t={threads} tiled={tiled} row {r}"
                    );
                }
                assert_eq!(bits(&cs), bits(&cs_all), "conv state m={m}");
                assert_eq!(bits(&s), bits(&s_all), "delta state m={m}");
                assert!(o_all.iter().all(|v| v.is_finite()));
            }
        }
    }
}

#[test]
fn the_row_check_catches_a_batch_dependent_op() {
    // Negative control: an "op" whose rows depend on the batch (normalizing by the
    // batch mean) must fail the same comparison the suite applies.
    let mut rng = Rng::new(6);
    let dim = 8;
    let x = rand_vec(&mut rng, 5 * dim, 1.0);
    let batch_norm = |x: &[f32]| -> Vec<f32> {
        let mean = x.iter().sum::<f32>() / x.len() as f32;
        x.iter().map(|v| v - mean).collect()
    };
    let all = batch_norm(&x);
    let one = batch_norm(&x[..dim]);
    assert_ne!(bits(&one), bits(&all[..dim]));
}

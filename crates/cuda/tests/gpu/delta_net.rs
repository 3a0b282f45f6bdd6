//! The linear-attention layer on the GPU (the conv, the q/k head norms, the
//! gated delta rule and the gated norm) at every key head dim its kernels
//! specialize: against one-row calls, replay and the CPU backend.

use super::*;

/// The delta-net shapes at every head dim the kernels specialize: the tiny
/// shapes (64) and tiny-qwen35moe at the real models' 128 and 256.
fn delta_head_dim_shapes() -> Vec<shapes::Shape> {
    let tiny = shapes::by_name("tiny-qwen35moe").unwrap();
    let mut cases = vec![shapes::by_name("tiny-qwen3next").unwrap(), tiny.clone()];
    for dk in [128, 256] {
        cases.push(shapes::Shape {
            delta: Some(shapes::DeltaNet {
                key_head_dim: dk,
                value_head_dim: dk,
                ..tiny.delta.unwrap()
            }),
            ..tiny.clone()
        });
    }
    cases
}

/// Row counts on both sides of the kernels' choices: one row, up to 16,
/// a full 16-row group, and wider calls with and without a partial group.
const DELTA_MS: &[usize] = &[1, 2, 5, 16, 17, 64, 100];

fn head_dim_label(shape: &shapes::Shape) -> String {
    format!("{} dk {}", shape.name, shape.delta.unwrap().key_head_dim)
}

/// Every block op, the delta net with its state among them, called on m
/// rows equals m one-row calls byte for byte, for every m of `DELTA_MS`, at
/// key and value head dims 64, 128 and 256. One row takes the one-launch
/// conv and head norms (`conv_l2_one`); up to 16 rows `conv_small` and the
/// warp-a-head norms; more, `conv_tile` and the lane-a-head norms. Calls of
/// 16 rows or more run the delta rule's full groups unrolled, smaller ones
/// the pipelined loop.
#[test]
#[ignore = "needs a CUDA device (scripts/gpu.sh runs it with --include-ignored)"]
fn delta_net_obeys_the_row_contract_at_every_head_dim() {
    if !gpu() {
        return;
    }
    for shape in delta_head_dim_shapes() {
        let what = head_dim_label(&shape);
        let (_d, model) = synth_shape(shape, GgmlType::Q4_K, 13);
        let cuda = Cuda::new(0, &model, false).unwrap();
        if let Err(e) = block_ops_match(&cuda, &model, DELTA_MS, 77) {
            panic!("{what}: {e}");
        }
        eprintln!("{what}: every block op row-invariant for m in {DELTA_MS:?}");
    }
}

/// Every position's logits over 300 tokens fed in chunks of 64 (four full
/// 16-row groups a call), 300 (18 full groups and a partial one in one
/// call) and 7 (partial groups only) byte-equal to replay (one row a call),
/// at key and value head dims 64, 128 and 256 (the delta-net shapes' conv
/// has 4 taps: `conv_tile`'s case in the wide calls).
#[test]
#[ignore = "needs a CUDA device (scripts/gpu.sh runs it with --include-ignored)"]
fn batched_delta_net_equals_replay_at_every_head_dim() {
    if !gpu() {
        return;
    }
    for shape in delta_head_dim_shapes() {
        let what = head_dim_label(&shape);
        assert_eq!(shape.delta.unwrap().conv_kernel, 4, "{what}: conv taps");
        let (_d, model) = synth_shape(shape, GgmlType::Q4_K, 29);
        let cuda = Cuda::new(0, &model, false).unwrap();
        let toks = test_tokens(&model, 31);
        let replay = all_logits(&cuda, &model, &toks, 1);
        assert!(replay.iter().all(|v| v.is_finite()), "{what}: non-finite");
        for chunk in [64, 300, 7] {
            let batched = all_logits(&cuda, &model, &toks, chunk);
            assert!(
                same_bits(&batched, &replay),
                "{what} chunk {chunk}: batched != replay"
            );
        }
        eprintln!("{what}: chunks 64, 300 and 7 byte-equal to replay");
    }
}

/// Each block op against the CPU backend at key and value head dims 128 and
/// 256 (the tiny shapes' 64 are compared with the other shapes'), f32
/// weights, calls of 1, 7 and 64 rows (the delta net twice, the second call
/// from the state the first left). The bar is ten times the tiny shapes'
/// f32 one: the sums of the wider heads run in other orders on the two
/// backends, and a wrong kernel misses it by orders of magnitude.
#[test]
#[ignore = "needs a CUDA device (scripts/gpu.sh runs it with --include-ignored)"]
fn delta_net_matches_the_cpu_backend_at_wide_head_dims() {
    if !gpu() {
        return;
    }
    let cpu = Cpu::new(2);
    for shape in delta_head_dim_shapes().into_iter().skip(2) {
        let what = head_dim_label(&shape);
        let (_d, model) = synth_shape(shape, GgmlType::F32, 3);
        let cuda = Cuda::new(0, &model, false).unwrap();
        for m in [1, 7, 64] {
            ops_close(&model, &cuda, &cpu, m, 1e-4, &what);
        }
    }
}

/// A decode step of several sequences runs the conv and the delta rule of
/// all their rows in one launch each (`conv_l2_one_seqs`, the delta rule's
/// `_seqs` form, each row's states from a table): every sequence's logits
/// and final state byte-equal to the same steps run alone, at key head
/// dims 64, 128 and 256, sequences at different positions.
#[test]
#[ignore = "needs a CUDA device (scripts/gpu.sh runs it with --include-ignored)"]
fn delta_net_decode_rows_of_several_sequences_equal_each_alone() {
    use samesum_engine::{Segment, forward_batch};
    if !gpu() {
        return;
    }
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for shape in delta_head_dim_shapes() {
        let what = head_dim_label(&shape);
        let dk = shape.delta.unwrap().key_head_dim;
        let (_d, model) = synth_shape(shape, GgmlType::Q4_K, 43);
        let cuda = Cuda::new(0, &model, false).unwrap();
        let mut rng = Rng::new(47);
        let v = model.w.n_vocab as u64;
        let lens = [1usize, 9, 40, 17, 70];
        let steps = 4;
        let toks: Vec<Vec<u32>> = lens
            .iter()
            .map(|&n| (0..n + steps).map(|_| rng.below(v) as u32).collect())
            .collect();
        let [mut together, mut alone] =
            prefilled_twice(&model, &cuda, &toks, &lens, 128, KvType::F32);
        for k in 0..steps {
            let mut segs: Vec<Segment<'_, _>> = together
                .iter_mut()
                .enumerate()
                .map(|(i, st)| Segment {
                    state: st,
                    tokens: &toks[i][lens[i] + k..lens[i] + k + 1],
                    want: Logits::Last,
                })
                .collect();
            let got = forward_batch(&model, &cuda, &mut segs).unwrap();
            assert_eq!(
                cuda.last_delta_kernel(),
                match dk {
                    256 => "delta_cols_async_256_seqs".to_string(),
                    _ => format!("delta_cols_async_pipe_{dk}_seqs"),
                },
                "{what}: a step of several decode rows takes the one-launch kernels"
            );
            for (i, want) in got.iter().enumerate() {
                let tok = &toks[i][lens[i] + k..lens[i] + k + 1];
                let one = forward(&model, &cuda, &mut alone[i], tok, Logits::Last).unwrap();
                assert!(want.iter().all(|x| x.is_finite()), "{what}: non-finite");
                assert_eq!(
                    bits(want),
                    bits(&one),
                    "{what}: step {k}, sequence {i} differs from alone"
                );
            }
        }
        for i in 0..lens.len() {
            assert_eq!(
                bits(&cuda.download_state(&together[i]).unwrap()),
                bits(&cuda.download_state(&alone[i]).unwrap()),
                "{what}: state of sequence {i}"
            );
        }
        eprintln!(
            "{what}: decode rows of {} sequences in one launch == each alone",
            lens.len()
        );
    }
}

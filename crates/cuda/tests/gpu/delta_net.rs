//! The short conv and the gated delta rule on the GPU.

use super::*;

/// The delta rule's cp.async-staged kernels (`delta_cols_async_*`, the
/// default, and with `SAMESUM_CUDA_DELTA_PIPE=1`) against the plain ones
/// (`SAMESUM_CUDA_DELTA_ASYNC=0`): every
/// position's logits byte-equal over 300 tokens in chunks of 64 and of 7
/// (full and partial row groups, one group and several in a call), and
/// byte-equal to their own replay, at key head dims 64 (the tiny shapes),
/// 128 (qwen35moe-35b-a3b) and 256 (eight-row groups).
#[test]
fn staged_delta_rule_equals_the_plain_one() {
    if !gpu() {
        return;
    }
    for shape in delta_head_dim_shapes() {
        let dk = shape.delta.unwrap().key_head_dim;
        let what = format!("{} dk {dk}", shape.name);
        let (_d, model) = synth_shape(shape, GgmlType::Q4_K, 13);
        let mut plain = Cuda::new(0, &model, false).unwrap();
        plain.set_switch("DELTA_ASYNC", false).unwrap();
        let toks = test_tokens(&model, 11);
        let want: Vec<Vec<f32>> = [64, 7]
            .iter()
            .map(|&chunk| all_logits(&plain, &model, &toks, chunk))
            .collect();
        for pipe in [false, true] {
            let mut staged = Cuda::new(0, &model, false).unwrap();
            staged.set_switch("DELTA_ASYNC", true).unwrap();
            staged.set_switch("DELTA_PIPE", pipe).unwrap();
            let replay = all_logits(&staged, &model, &toks, 1);
            assert!(replay.iter().all(|v| v.is_finite()), "{what}: non-finite");
            for (chunk, a) in [64, 7].into_iter().zip(&want) {
                let b = all_logits(&staged, &model, &toks, chunk);
                assert!(
                    same_bits(a, &b),
                    "{what} pipe {pipe} chunk {chunk}: staged != plain"
                );
                assert!(
                    same_bits(&b, &replay),
                    "{what} pipe {pipe} chunk {chunk}: staged batched != its replay"
                );
            }
        }
        eprintln!(
            "{what}: staged delta rule (pipelined or not) == plain == replay, chunks 64 and 7"
        );
    }
}

/// The delta rule's full 16-row groups as straight-line code
/// (`DELTA_UNROLL`, `delta_cols_async_unroll_*`) and with the k dot's
/// partials summed through shared memory (`DELTA_XCHG`,
/// `delta_cols_async_xchg_*`), and with each full group's last row taking
/// the next full group's first k and decay (`DELTA_CARRY`,
/// `delta_cols_async_carry_*`), and with three staging buffers (`DELTA_TRI`,
/// `delta_cols_async_tri_*`), against the pipelined loop: the same logits
/// bytes at key head dims 64 and 128 in chunks of 64 (four full groups a
/// call), 300 (18 full groups and a partial one) and 7 (partial groups
/// only), and replayed (every decode call is one partial group), with the
/// kernel each arm takes checked by name.
#[test]
fn unrolled_delta_rows_equal_the_pipelined_loop() {
    if !gpu() {
        return;
    }
    for shape in delta_head_dim_shapes() {
        let dk = shape.delta.unwrap().key_head_dim as usize;
        if dk != 64 && dk != 128 {
            continue;
        }
        let what = format!("{} dk {dk}", shape.name);
        let (_d, model) = synth_shape(shape, GgmlType::Q4_K, 29);
        let toks = test_tokens(&model, 31);
        let mut looped = Cuda::new(0, &model, false).unwrap();
        looped.set_switch("DELTA_UNROLL", false).unwrap();
        assert_eq!(
            looped.delta_kernel(dk, 64),
            Some(if dk == 64 {
                "delta_cols_async_pipe_64"
            } else {
                "delta_cols_async_pipe_128"
            })
        );
        let want: Vec<Vec<f32>> = [1, 64, 300, 7]
            .iter()
            .map(|&chunk| all_logits(&looped, &model, &toks, chunk))
            .collect();
        assert!(want[0].iter().all(|v| v.is_finite()), "{what}: non-finite");
        for kind in ["unroll", "xchg", "carry", "tri"] {
            let mut arm = Cuda::new(0, &model, false).unwrap();
            arm.set_switch("DELTA_UNROLL", true).unwrap();
            arm.set_switch("DELTA_XCHG", kind == "xchg").unwrap();
            arm.set_switch("DELTA_CARRY", kind == "carry").unwrap();
            arm.set_switch("DELTA_TRI", kind == "tri").unwrap();
            let name = arm.delta_kernel(dk, 64).unwrap();
            assert_eq!(
                arm.delta_kernel(dk, 1),
                looped.delta_kernel(dk, 1),
                "decode-sized calls keep the loop's kernel"
            );
            assert_eq!(name, format!("delta_cols_async_{kind}_{dk}"));
            for (chunk, a) in [1, 64, 300, 7].into_iter().zip(&want) {
                let b = all_logits(&arm, &model, &toks, chunk);
                assert!(same_bits(a, &b), "{what} {name} chunk {chunk}: != the loop");
                assert!(
                    same_bits(&want[0], &b),
                    "{what} {name} chunk {chunk}: != replay"
                );
            }
        }
        eprintln!(
            "{what}: unrolled, exchanged and carried delta rows == the pipelined loop == replay"
        );
    }
}

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

/// Prefill's causal conv with a thread per channel and 16 rows (`conv_tile`,
/// `CONV_TILE`) against conv_rows: the same logits bytes for chunks that
/// start inside a 16-row group, span several, or end part way through one
/// (the tiny delta-net shapes' conv has 4 taps, the tile kernel's case).
#[test]
fn tiled_conv_equals_the_row_kernel() {
    if !gpu() {
        return;
    }
    let cases = named_shapes(&["tiny-qwen3next", "tiny-qwen35moe"]);
    for sh in &cases {
        let conv = sh.delta.unwrap().conv_kernel;
        assert_eq!(conv, 4, "{}: the tile kernel's conv size", sh.name);
    }
    assert_switch_keeps_logits(
        cases,
        |s| s.name.to_string(),
        (23, 29),
        "CONV_TILE",
        &[17, 64, 300],
        "conv_tile and conv_rows",
    );
}

/// The f64 head sums of squares with every lane squaring (`SQ_LANES`)
/// against lane 0 squaring them all: the same logits bytes on the delta-net
/// shapes (l2norm_qk and gated_norm_q8k in prefill; decode-sized calls take
/// lane 0's squares in both arms).
#[test]
fn lane_squares_equal_lane_zero_squares() {
    if !gpu() {
        return;
    }
    assert_switch_keeps_logits(
        delta_head_dim_shapes(),
        |s| format!("{} dk {}", s.name, s.delta.unwrap().key_head_dim),
        (31, 37),
        "SQ_LANES",
        &[1, 64, 300],
        "lane squares and lane-0 squares",
    );
}

/// The f64 head sums of squares a lane a head (`HEAD_SUMS`:
/// `gated_norm_q8k_h` and `l2norm_qk_h`, 32 heads a block, the tail block
/// part full where the call's heads are not a multiple of 32) against a
/// warp a head: the same logits bytes on the delta-net shapes, head dims
/// from the tiny shapes' to 256, in chunks of 64 and 300 (wide calls) and
/// replayed (decode-sized calls take lane 0's squares in both arms).
#[test]
fn head_sums_a_lane_a_head_equal_the_warp_sums() {
    if !gpu() {
        return;
    }
    assert_switch_keeps_logits(
        delta_head_dim_shapes(),
        |s| format!("{} dk {}", s.name, s.delta.unwrap().key_head_dim),
        (41, 43),
        "HEAD_SUMS",
        &[1, 64, 300],
        "a lane a head and a warp a head",
    );
}

/// Decode's delta-net output projection taking the gated norm itself
/// (`GN_FOLD`, `mm_q4_k_lane_gn_1`) against gated_norm_q8k and the lane
/// matmul: the same logits bytes at every replayed position and with
/// chunks of 7 and 64 (whose calls do not take the fold, so the fold's
/// one-row bytes meet the wide path's in one sequence), graphs on and off,
/// on the shapes with delta-net layers (Q4_K and Q8_0: the fold is Q4_K
/// only); and the fold's arm launched fewer kernels, one a delta layer a
/// token.
#[test]
fn gated_norm_in_the_output_projection_changes_no_byte() {
    if !gpu() {
        return;
    }
    let mut folded = 0;
    for shape in SHAPES {
        for quant in [GgmlType::Q4_K, GgmlType::Q8_0] {
            let (_d, model) = synth(shape, quant, 43);
            let delta_layers = model
                .w
                .layers
                .iter()
                .filter(|l| matches!(l.mixer, Mixer::Linear(_)))
                .count();
            if delta_layers == 0 {
                continue;
            }
            let toks: Vec<u32> = test_tokens(&model, 9).into_iter().take(80).collect();
            for graphs in [false, true] {
                let (on, off) = graph_switch_arms(&model, "GN_FOLD", graphs);
                assert_same_logits(
                    &on,
                    &off,
                    &model,
                    &toks,
                    &[1, 7, 64],
                    &format!("{shape} {quant:?}: the folded gated norm differs (graphs {graphs})"),
                );
                if !graphs {
                    let (a, b) = (on.device().launch_count(), off.device().launch_count());
                    if quant == GgmlType::Q4_K {
                        // 80 replayed tokens: one launch fewer a delta layer each.
                        assert_eq!(
                            b - a,
                            (80 * delta_layers) as u64,
                            "{shape}: {a} launches with the fold, {b} without"
                        );
                        folded += 1;
                    } else {
                        assert_eq!(a, b, "{shape} {quant:?}: the fold ran on a Q8_0 projection");
                    }
                }
            }
            eprintln!("{shape} {quant:?}: the folded gated norm == gated_norm_q8k + the matmul");
        }
    }
    assert!(folded >= 2, "the fold ran on {folded} shapes");
}

/// The delta net's gated norm and the gated attention's output gate writing
/// the out projection's Q8_K blocks (`gated_norm_q8k`, `sigmoid_mul_q8k`)
/// against gated_norm or sigmoid_mul and a quantize launch: the same logits
/// bytes at every position, replayed and in chunks of 64 and 7, on the tiny
/// shapes with a delta net (their value heads of 64 and of 128; their
/// attention layers are gated).
#[test]
fn gated_norm_quantization_equals_a_quantize_launch() {
    if !gpu() {
        return;
    }
    let tiny = shapes::by_name("tiny-qwen35moe").unwrap();
    let wide = shapes::Shape {
        delta: Some(shapes::DeltaNet {
            key_head_dim: 128,
            value_head_dim: 128,
            ..tiny.delta.unwrap()
        }),
        ..tiny.clone()
    };
    for shape in [shapes::by_name("tiny-qwen3next").unwrap(), tiny, wide] {
        let what = format!("{} dv {}", shape.name, shape.delta.unwrap().value_head_dim);
        let (_d, model) = synth_shape(shape, GgmlType::Q4_K, 31);
        // The out projections read Q8_K rows, so the fused path is the one taken.
        let outs: Vec<GgmlType> = model
            .w
            .layers
            .iter()
            .filter_map(|l| match &l.mixer {
                Mixer::Linear(dn) => Some(dn.out.ty),
                _ => None,
            })
            .collect();
        assert!(
            !outs.is_empty()
                && outs
                    .iter()
                    .all(|t| matches!(t, GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K)),
            "{what}: out projections {outs:?}"
        );
        let mut fused = Cuda::new(0, &model, false).unwrap();
        fused.set_switch("GN_Q8K", true).unwrap();
        let mut apart = Cuda::new(0, &model, false).unwrap();
        apart.set_switch("GN_Q8K", false).unwrap();
        let toks = test_tokens(&model, 17);
        for chunk in [1, 64, 7] {
            let (p, q) = (
                all_logits(&fused, &model, &toks, chunk),
                all_logits(&apart, &model, &toks, chunk),
            );
            assert!(p.iter().all(|v| v.is_finite()), "{what}: non-finite");
            assert!(
                same_bits(&p, &q),
                "{what} chunk {chunk}: gated_norm_q8k != gated_norm + quantize"
            );
        }
        eprintln!("{what}: gated_norm_q8k == gated_norm + quantize_q8k (replay, chunks 64 and 7)");
    }
}

/// One decode row's conv, state shift and q/k head norms in one launch
/// (`conv_l2_one`) against conv_small and l2norm_qk: the same logits bytes
/// at every position, replayed and in chunks, on the delta-net shapes (key
/// and value heads of 64, and of 128 as the real models'), and fewer
/// launches.
#[test]
fn conv_and_head_norms_in_one_launch_equal_the_separate_kernels() {
    if !gpu() {
        return;
    }
    let tiny = shapes::by_name("tiny-qwen35moe").unwrap();
    let wide = shapes::Shape {
        delta: Some(shapes::DeltaNet {
            key_head_dim: 128,
            value_head_dim: 128,
            ..tiny.delta.unwrap()
        }),
        ..tiny.clone()
    };
    for shape in [shapes::by_name("tiny-qwen3next").unwrap(), tiny, wide] {
        let what = format!("{} dk {}", shape.name, shape.delta.unwrap().key_head_dim);
        let (_d, model) = synth_shape(shape, GgmlType::Q4_K, 47);
        let (on, off) = fusion_arms(&model, "CONV_L2", 19, KvType::F32, &what);
        assert!(on < off, "{what}: {on} launches fused, {off} apart");
        eprintln!("{what}: conv_l2_one == conv_small + l2norm_qk; launches {on} against {off}");
    }
}

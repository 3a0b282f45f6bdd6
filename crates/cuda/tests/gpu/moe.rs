//! Routing, the expert plan and the combine on the GPU.

use super::*;

/// The one-launch expert plan (small calls) against the three-kernel plan
/// and a plain host reference, on random routings with skipped (-1) ids:
/// places padded per expert, pairs in token order, unused places -1.
/// Routing and the plan in one launch (decode sizes) against `route` and the
/// three-kernel plan: softmaxed logits, ids, weights and places, byte for
/// byte, with ties among the logits.
#[test]
fn the_one_launch_route_and_plan_equal_the_separate_kernels() {
    if !gpu() {
        return;
    }
    let (_d, model) = synth("tiny-qwen3moe", GgmlType::Q8_0, 1);
    let mut cuda = Cuda::new(0, &model, false).unwrap();
    let mut rng = Rng::new(4);
    let mut cases = 0;
    // With block routing, m <= 4 (e <= 1024) routes each row with the whole
    // block (ranks); otherwise (the default, and larger m) a row per warp
    // (argmax rounds, the ids handed to the plan in shared memory); all
    // against `route` and the three-kernel plan.
    let mut nans = 0;
    // Modes: one row by route_plan_one (the default), by route_plan_small's
    // warp path, by the whole block, by route_plan_one_r (`ROUTE_REGS`: the
    // row in registers for e <= 256, route_plan_one's code past that and
    // for rows with a NaN).
    let mut regs = 0;
    for (mode, e) in [0, 1, 2, 3]
        .into_iter()
        .flat_map(|b| [8usize, 128, 200, 256, 512, 1024].map(|e| (b, e)))
    {
        cuda.set_route_one(mode == 0 || mode == 3);
        cuda.set_block_route(mode == 2);
        cuda.set_switch("ROUTE_REGS", mode == 3).unwrap();
        let want = if mode == 3 {
            "route_plan_one_r"
        } else {
            "route_plan_one"
        };
        assert_eq!(cuda.route_kernels().1, want);
        // k = 32, the most one warp routes, on the one-row kernels.
        let ks: &[usize] = if mode == 0 || mode == 3 {
            &[1, 2, 8, 32]
        } else {
            &[1, 2, 8]
        };
        for &k in ks {
            for m in [1usize, 2, 3, 4, 16, 32] {
                if m * k > 256 || k > e || (k == 32 && m > 1) {
                    continue;
                }
                for pad in [1usize, 16] {
                    // Logits on a coarse grid, so equal values (ties) occur.
                    let mut lg: Vec<f32> = (0..m * e)
                        .map(|_| (rng.below(16) as f32 - 8.0) * 0.25)
                        .collect();
                    // Some rows hold a NaN (the block path falls back to the
                    // argmax rounds there).
                    if rng.below(4) == 0 {
                        lg[rng.below((m * e) as u64) as usize] = f32::NAN;
                        nans += 1;
                    }
                    let one = cuda.route_plan_host(&lg, m, k, pad, true).unwrap();
                    let sep = cuda.route_plan_host(&lg, m, k, pad, false).unwrap();
                    let fb = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(fb(&one.0), fb(&sep.0), "e={e} k={k} m={m}: softmax");
                    assert_eq!(one.1, sep.1, "e={e} k={k} m={m}: ids");
                    // A row holding a NaN may name -1 (a skipped pick: the
                    // argmax rounds do not order NaNs; seen on the H200 in
                    // session 7 on both paths alike); other rows name experts.
                    for (r, row) in one.1.chunks(k).enumerate() {
                        let nan = lg[r * e..(r + 1) * e].iter().any(|v| v.is_nan());
                        let lo = if nan { -1 } else { 0 };
                        assert!(
                            row.iter().all(|&i| i >= lo && i < e as i32),
                            "e={e} k={k} m={m} row {r}: ids {row:?}"
                        );
                    }
                    assert_eq!(fb(&one.2), fb(&sep.2), "e={e} k={k} m={m}: weights");
                    // Rows without a NaN against the host: the k largest of
                    // the GPU's softmax, larger first and lower id among
                    // equals, weighed by their sum in that order (so a
                    // shortcut shared by both kernels is checked too).
                    for r in 0..m {
                        if lg[r * e..(r + 1) * e].iter().any(|v| v.is_nan()) {
                            continue;
                        }
                        let row = &one.0[r * e..(r + 1) * e];
                        let mut order: Vec<usize> = (0..e).collect();
                        order
                            .sort_by(|&a, &b| row[b].partial_cmp(&row[a]).unwrap().then(a.cmp(&b)));
                        let want: Vec<i32> = order[..k].iter().map(|&i| i as i32).collect();
                        assert_eq!(
                            &one.1[r * k..(r + 1) * k],
                            &want[..],
                            "e={e} k={k} m={m} row {r}: host top k"
                        );
                        let tot = order[..k]
                            .iter()
                            .fold(0.0f32, |t, &i| t + row[i])
                            .max(2f32.powi(-14));
                        for (s, &i) in order[..k].iter().enumerate() {
                            assert_eq!(
                                one.2[r * k + s].to_bits(),
                                (row[i] / tot).to_bits(),
                                "e={e} k={k} m={m} row {r} pick {s}: host weight"
                            );
                        }
                    }
                    // A skipped pick weighs nothing.
                    for (i, w) in one.1.iter().zip(&one.2) {
                        assert!(
                            *i >= 0 || *w == 0.0,
                            "e={e} k={k} m={m}: pick -1 weighs {w}"
                        );
                    }
                    assert_eq!(one.3, sep.3, "e={e} k={k} m={m} pad={pad}: placed rows");
                    assert_eq!(one.4, sep.4, "e={e} k={k} m={m} pad={pad}: placed experts");
                    assert_eq!(one.5, sep.5, "e={e} k={k} m={m} pad={pad}: slots");
                    cases += 1;
                    regs += usize::from(mode == 3 && m == 1 && e <= 256);
                }
            }
        }
    }
    assert!(
        cases > 100 && nans > 10,
        "too few cases: {cases} ({nans} with a NaN)"
    );
    assert!(regs > 20, "too few register-path cases: {regs}");
    eprintln!(
        "{cases} routings equal (one launch, route + plan), {nans} with a NaN logit, {regs} on route_plan_one_r's registers"
    );
}

#[test]
fn the_one_launch_plan_equals_the_three_kernel_plan() {
    if !gpu() {
        return;
    }
    let (_d, model) = synth("tiny-qwen3moe", GgmlType::Q8_0, 1);
    let cuda = Cuda::new(0, &model, false).unwrap();
    let mut rng = Rng::new(21);
    let mut cases = 0;
    for e in [8usize, 128, 256, 512, 2048] {
        for k in [1usize, 2, 8] {
            for n in [1usize, 2, 7, 8, 64, 100, 255, 256] {
                if n % k != 0 {
                    continue;
                }
                for pad in [1usize, 16] {
                    let ids: Vec<i32> = (0..n)
                        .map(|_| {
                            if rng.below(10) == 0 {
                                -1
                            } else {
                                // Half the routings crowd 4 experts (many pairs each).
                                let span = if rng.below(2) == 0 { e.min(4) } else { e };
                                rng.below(span as u64) as i32
                            }
                        })
                        .collect();
                    // Host reference.
                    let cap = n + e.min(n) * (pad - 1);
                    let want = samesum_cuda::backend::plan_reference(&ids, k, e, pad, cap);
                    let small = cuda.plan_host(&ids, k, e, pad, true).unwrap();
                    let three = cuda.plan_host(&ids, k, e, pad, false).unwrap();
                    assert_eq!(
                        three, want,
                        "three-kernel plan: e={e} k={k} n={n} pad={pad}"
                    );
                    assert_eq!(small, want, "one-launch plan: e={e} k={k} n={n} pad={pad}");
                    cases += 1;
                }
            }
        }
    }
    eprintln!("{cases} plans equal (one launch, three launches, host)");
}

/// Wide calls' plan in two launches (`PLAN_WIDE`: plan_count, then
/// `plan_place_wide`, which also takes plan_scan's offsets) against the
/// host reference and the three-kernel plan, on pair counts of wide calls
/// (300 to 4,097 rows of 1, 2 or 8 pairs: n from 300 to 32,776, so passes
/// of 8,192 pairs whole and cut, and a last run of 32 cut, n odd among
/// them), skipped (-1) ids, crowded experts (a third of the cases put every
/// pair on 4 experts), pads of 1, 16 and 32.
#[test]
fn the_wide_plan_equals_the_three_kernel_plan() {
    if !gpu() {
        return;
    }
    let (_d, model) = synth("tiny-qwen3moe", GgmlType::Q8_0, 1);
    let mut cuda = Cuda::new(0, &model, false).unwrap();
    let mut rng = Rng::new(31);
    let mut cases = 0;
    for e in [8usize, 128, 256, 512, 2048] {
        for k in [1usize, 2, 8] {
            for rows in [300usize, 1000, 1025, 2048, 4097] {
                let n = rows * k;
                for pad in [1usize, 16, 32] {
                    let crowd = rng.below(3) == 0;
                    let ids: Vec<i32> = (0..n)
                        .map(|_| {
                            if rng.below(10) == 0 {
                                -1
                            } else {
                                let span = if crowd { e.min(4) } else { e };
                                rng.below(span as u64) as i32
                            }
                        })
                        .collect();
                    let cap = n + e.min(n) * (pad - 1);
                    let want = samesum_cuda::backend::plan_reference(&ids, k, e, pad, cap);
                    cuda.set_switch("PLAN_WIDE", true).unwrap();
                    let wide = cuda.plan_host(&ids, k, e, pad, false).unwrap();
                    cuda.set_switch("PLAN_WIDE", false).unwrap();
                    let three = cuda.plan_host(&ids, k, e, pad, false).unwrap();
                    assert_eq!(wide, want, "wide plan: e={e} k={k} n={n} pad={pad}");
                    assert_eq!(
                        three, want,
                        "three-kernel plan: e={e} k={k} n={n} pad={pad}"
                    );
                    cases += 1;
                }
            }
        }
    }
    eprintln!("{cases} wide plans equal (two launches, three launches, host)");
}

/// The MoE combine as an op (`moe_combine_host`): four columns a thread
/// (`COMBINE_VEC`) against a thread a column, and each row of an m-row call
/// against that row alone, byte for byte, outputs NaN-poisoned; routed
/// rows with skipped (-1) slots, with and without a shared expert, widths
/// that take the four-column kernel and one that does not (10). Without a
/// shared expert, also against a host reference (f32 fmas in slot order:
/// the kernel's function, so a wrong order or a dropped term fails).
#[test]
fn moe_combine_rows_equal_single_rows_and_both_kernels() {
    if !gpu() {
        return;
    }
    let (_d, model) = synth("tiny-qwen3moe", GgmlType::Q4_K, 5);
    let (vec4, col) = switch_arms(&model, "COMBINE_VEC");
    let mut rng = Rng::new(73);
    let mut cases = 0;
    for d in [4usize, 10, 256, 2048] {
        for k in [1usize, 2, 6, 8, 10] {
            for m in [1usize, 2, 3, 17, 64] {
                for shared in [false, true] {
                    let n_out = m * k + 5;
                    let out: Vec<f32> = (0..n_out * d).map(|_| rng.normal()).collect();
                    let slot: Vec<i32> = (0..m * k)
                        .map(|_| {
                            if rng.below(7) == 0 {
                                -1
                            } else {
                                rng.below(n_out as u64) as i32
                            }
                        })
                        .collect();
                    let wts: Vec<f32> = (0..m * k).map(|_| rng.range(0.0, 1.0)).collect();
                    let ys: Vec<f32> = (0..m * d).map(|_| rng.normal()).collect();
                    let gi: Vec<f32> = (0..m).map(|_| rng.normal()).collect();
                    let sh = shared.then_some((&ys[..], &gi[..]));
                    let what = format!("d {d} k {k} m {m} shared {shared}");
                    let a = vec4
                        .moe_combine_host(&out, &slot, &wts, sh, m, k, d)
                        .unwrap();
                    let b = col
                        .moe_combine_host(&out, &slot, &wts, sh, m, k, d)
                        .unwrap();
                    assert!(
                        a.iter().all(|v| v.is_finite()),
                        "{what}: a poisoned output stayed"
                    );
                    assert!(same_bits(&a, &b), "{what}: moe_combine4 != moe_combine");
                    for r in 0..m {
                        let one = vec4
                            .moe_combine_host(
                                &out,
                                &slot[r * k..(r + 1) * k],
                                &wts[r * k..(r + 1) * k],
                                shared.then_some((&ys[r * d..(r + 1) * d], &gi[r..r + 1])),
                                1,
                                k,
                                d,
                            )
                            .unwrap();
                        assert!(
                            same_bits(&one, &a[r * d..(r + 1) * d]),
                            "{what}: row {r} alone differs"
                        );
                    }
                    if !shared {
                        let want: Vec<f32> = (0..m * d)
                            .map(|i| {
                                let (r, c) = (i / d, i % d);
                                (0..k).fold(0.0f32, |acc, s| match slot[r * k + s] {
                                    -1 => acc,
                                    at => wts[r * k + s].mul_add(out[at as usize * d + c], acc),
                                })
                            })
                            .collect();
                        assert!(same_bits(&a, &want), "{what}: not the slot-order sums");
                    }
                    cases += 1;
                }
            }
        }
    }
    // Sizes or slots that disagree are an error, not a launch.
    let (out, wts) = (vec![1.0f32; 4 * 8], vec![0.5f32; 2]);
    assert!(
        vec4.moe_combine_host(&out, &[0, 1], &wts, None, 1, 2, 8)
            .is_ok()
    );
    assert!(
        vec4.moe_combine_host(&out, &[0, 4], &wts, None, 1, 2, 8)
            .is_err()
    );
    assert!(
        vec4.moe_combine_host(&out, &[0], &wts, None, 1, 2, 8)
            .is_err()
    );
    assert!(
        vec4.moe_combine_host(&out[..7], &[0, 1], &wts, None, 1, 2, 8)
            .is_err()
    );
    assert!(
        vec4.moe_combine_host(&out, &[0, 1], &wts, Some((&out[..7], &wts[..1])), 1, 2, 8)
            .is_err()
    );
    eprintln!("moe_combine4 == moe_combine == single rows on {cases} cases");
}

/// Wide calls' MoE combine four columns a thread (`moe_combine4`,
/// `COMBINE_VEC`) against a thread a column: the same logits bytes with and
/// without a shared expert (tiny-qwen3moe has none), at 2 experts a token
/// (a part-filled group of four slots) and at 6 (a full group, then a
/// part-filled one).
#[test]
fn four_column_combine_equals_the_column_kernel() {
    if !gpu() {
        return;
    }
    let mut cases = named_shapes(SHAPES);
    for name in ["tiny-qwen3moe", "tiny-qwen35moe"] {
        cases.push(shapes::Shape {
            experts_used: 6,
            ..shapes::by_name(name).unwrap()
        });
    }
    assert!(cases.iter().all(|s| s.hidden % 4 == 0));
    assert!(cases.iter().any(|s| s.shared_ff == 0) && cases.iter().any(|s| s.shared_ff > 0));
    assert_switch_keeps_logits(
        cases,
        |s| format!("{} k {}", s.name, s.experts_used),
        (67, 71),
        "COMBINE_VEC",
        &[17, 64, 300],
        "moe_combine4 and moe_combine",
    );
}

/// Decode steps recorded as CUDA graphs and replayed against the same steps
/// launched one by one: the same logits bytes at every position, over more
/// than one attention key tile (the recorded step covers the whole context).
/// Every decode-size fusion (one-row and fused-GLU matmuls, routing with the
/// plan, the conv with its state shift, the quantized gather, programmatic
/// dependent launch) against the separate kernels, through whole forward
/// passes: 200 replayed steps and a prefill in chunks of 7 rows, byte for
/// byte.
/// Prefill with the shared expert on the second stream (beside the routed
/// experts) against the same prefill with it after them on the main stream:
/// every logit byte-equal, on the shapes with a shared expert, chunks that
/// take the overlap (64, 100) and one that does not (7).
#[test]
fn shared_expert_beside_the_routed_experts_equals_serial() {
    if !gpu() {
        return;
    }
    let mut checked = 0;
    for shape in SHAPES {
        let (_d, model) = synth(shape, GgmlType::Q4_K, 29);
        if model.w.layers.iter().all(|l| l.moe.shared.is_none()) {
            continue;
        }
        let mut side = Cuda::new(0, &model, false).unwrap();
        side.set_overlap(true);
        let mut serial = Cuda::new(0, &model, false).unwrap();
        serial.set_overlap(false);
        let mut rng = Rng::new(31);
        let toks: Vec<u32> = (0..300)
            .map(|_| rng.below(model.w.n_vocab as u64) as u32)
            .collect();
        for chunk in [64usize, 100, 7] {
            let (p, q) = (
                all_logits(&side, &model, &toks, chunk),
                all_logits(&serial, &model, &toks, chunk),
            );
            assert_eq!(p.len(), q.len());
            assert!(
                p.iter().all(|v| v.is_finite()),
                "{shape}: non-finite logits"
            );
            if let Some(i) = p
                .iter()
                .zip(&q)
                .position(|(a, b)| a.to_bits() != b.to_bits())
            {
                panic!(
                    "{shape} chunk {chunk}: the overlapped shared expert differs at position {}",
                    i / model.w.n_vocab
                );
            }
            checked += 1;
        }
        eprintln!("{shape}: shared expert on the second stream == serial (chunks 64, 100, 7)");
    }
    assert!(
        checked >= 6,
        "too few shapes with a shared expert: {checked} runs"
    );
}

/// Decode's router launch with a warp a block (`ROUTER_1W`) against four:
/// the same logits, so the same ids and plan.
#[test]
fn router_launch_a_warp_a_block_changes_no_byte() {
    if !gpu() {
        return;
    }
    decode_switch_changes_no_byte("ROUTER_1W", (47, 13, 60), &[1, 7], |_, _, _| {});
}

/// A decode MoE layer's router launch routing and planning its own row
/// (`mm_f32_multi_route`) against mm_f32_multi (or the router's matmul)
/// then route_plan_one: the same logits bytes at every position, replayed
/// (graph replays reuse the launch's counter) and in chunks, on every tiny
/// shape (routers with and without a shared expert's gate beside them), and
/// one launch fewer a MoE layer and token.
#[test]
fn routing_in_the_router_launch_equals_route_plan_one() {
    if !gpu() {
        return;
    }
    for shape in SHAPES {
        let (_d, model) = synth(shape, GgmlType::Q4_K, 41);
        let (on, off) = fusion_arms(&model, "ROUTE_FOLD", 11, KvType::F32, shape);
        assert!(on < off, "{shape}: {on} launches folded, {off} apart");
        eprintln!(
            "{shape}: mm_f32_multi_route == router + route_plan_one; launches {on} against {off}"
        );
    }
}

/// Tiny shape `name` with a real model's router: rows of `hidden`, `experts`
/// experts and 8 a token, two layers (to keep the weights small).
fn router_shape(name: &str, hidden: u32, experts: u32) -> shapes::Shape {
    shapes::Shape {
        hidden,
        layers: 2,
        experts,
        experts_used: 8,
        ..shapes::by_name(name).unwrap()
    }
}

/// The router launch that routes a decode row, on its variants: the row
/// routed in registers (`ROUTE_REGS`: `mm_f32_multi_route_r`), 32 loads a
/// lane a step (`ROUTER_DEEP`: `_d`), and both (`_rd`), against the default
/// (`mm_f32_multi_route`): the same logits bytes at every position,
/// replayed and in chunks of 64 and 7, on the tiny shapes and on wider ones
/// whose rows take every path: hidden 2,304 (a lane's 72 elements in steps
/// of 32, 32 and 8), 256 experts with 8 a token (qwen35moe's router, the
/// registers' largest row) and 128 (qwen3moe's), and 320 (past the
/// registers: route_one_warp's code).
#[test]
fn router_launch_variants_keep_the_logits() {
    if !gpu() {
        return;
    }
    let mut shapes: Vec<shapes::Shape> =
        SHAPES.iter().map(|s| shapes::by_name(s).unwrap()).collect();
    for (name, experts) in [
        ("tiny-qwen35moe", 256),
        ("tiny-qwen3moe", 128),
        ("tiny-qwen3moe", 320),
    ] {
        shapes.push(router_shape(name, 2304, experts));
    }
    let arms = [
        (false, false, "mm_f32_multi_route"),
        (true, false, "mm_f32_multi_route_r"),
        (false, true, "mm_f32_multi_route_d"),
        (true, true, "mm_f32_multi_route_rd"),
    ];
    for shape in shapes {
        let what = format!(
            "{} hidden {} experts {}",
            shape.name, shape.hidden, shape.experts
        );
        let (_d, model) = synth_shape(shape, GgmlType::Q4_K, 53);
        let toks = test_tokens(&model, 23);
        let mut first: Option<Vec<f32>> = None;
        for (regs, deep, name) in arms {
            let mut cuda = Cuda::new(0, &model, false).unwrap();
            cuda.set_switch("ROUTE_REGS", regs).unwrap();
            cuda.set_switch("ROUTER_DEEP", deep).unwrap();
            assert_eq!(cuda.route_kernels().0, name);
            for chunk in [1, 64, 7] {
                let p = all_logits(&cuda, &model, &toks, chunk);
                assert!(p.iter().all(|v| v.is_finite()), "{what} {name}: non-finite");
                match &first {
                    None => first = Some(p),
                    Some(r) => assert!(
                        same_bits(r, &p),
                        "{what} chunk {chunk}: {name} != the default replayed"
                    ),
                }
            }
        }
        eprintln!("{what}: the four router launches equal, replayed and in chunks");
    }
}

/// Decode's post-mixer norm inside the MoE's router launch (`NORM_ROUTER`:
/// `mm_f32_multi_route_norm`, every block taking add_rms_norm_q8k's norm of
/// the row, the last storing the residual, the normed row and its Q8_K
/// rows) against add_rms_norm_q8k then the router launch: the same logits
/// bytes at every position, replayed (graph replays too) and in chunks, on
/// every tiny shape (hidden 256: one element of each of norm_row's threads)
/// and on hidden 2,048 as the real models' (eight elements a thread, eight
/// Q8_K blocks) with 256 experts and a shared expert (qwen35moe's router)
/// and 128 without (qwen3moe's), and fewer launches.
#[test]
fn post_mixer_norm_in_the_router_launch_equals_the_norm_launch() {
    if !gpu() {
        return;
    }
    let mut shapes: Vec<shapes::Shape> =
        SHAPES.iter().map(|s| shapes::by_name(s).unwrap()).collect();
    for (name, experts) in [("tiny-qwen35moe", 256), ("tiny-qwen3moe", 128)] {
        shapes.push(router_shape(name, 2048, experts));
    }
    for shape in shapes {
        let what = format!(
            "{} hidden {} experts {}",
            shape.name, shape.hidden, shape.experts
        );
        let (_d, model) = synth_shape(shape, GgmlType::Q4_K, 67);
        let (on, off) = fusion_arms(&model, "NORM_ROUTER", 37, KvType::F32, &what);
        assert!(
            on < off,
            "{what}: {on} launches with the norm in the router launch, {off} apart"
        );
        eprintln!(
            "{what}: the norm in the router launch == add_rms_norm_q8k + router; launches {on} against {off}"
        );
    }
}

/// Ungated attention's combine writing the out projection's Q8_K rows
/// (`attention_combine_q8k`) against attention_combine and a quantize
/// launch: the same logits bytes at every position (300 tokens: two key
/// tiles), replayed and in chunks, on tiny-qwen3moe and on Q4_K models of
/// the real models' ungated head shapes, and fewer launches.
#[test]
fn combine_quantization_equals_a_quantize_launch() {
    if !gpu() {
        return;
    }
    let base = shapes::by_name("tiny-qwen3moe").unwrap();
    let mut models = vec![(
        "tiny-qwen3moe".to_string(),
        synth("tiny-qwen3moe", GgmlType::Q4_K, 53),
    )];
    for (heads, kv_heads, head_dim) in [(32u32, 4u32, 128u32), (16, 4, 128)] {
        let shape = shapes::Shape {
            heads,
            kv_heads,
            head_dim,
            layers: 1,
            ..base.clone()
        };
        models.push((
            format!("attention {heads}/{kv_heads} x {head_dim}"),
            synth_shape(shape, GgmlType::Q4_K, 53),
        ));
    }
    for (what, (_d, model)) in &models {
        let (on, off) = fusion_arms(model, "COMBINE_Q8K", 23, KvType::F32, what);
        assert!(on < off, "{what}: {on} launches fused, {off} apart");
        eprintln!(
            "{what}: attention_combine_q8k == combine + quantize_q8k; launches {on} against {off}"
        );
    }
}

/// A decode MoE's combine adding into the residual and running the next
/// layer's input norm (`moe_combine_add_rms_norm_q8k`) against moe_combine
/// and add_rms_norm_q8k: the same logits bytes at every position, replayed
/// and in chunks, on every tiny shape (with and without a shared expert),
/// and fewer launches.
#[test]
fn moe_combine_with_the_next_norm_equals_the_separate_kernels() {
    if !gpu() {
        return;
    }
    for shape in SHAPES {
        let (_d, model) = synth(shape, GgmlType::Q4_K, 59);
        let (on, off) = fusion_arms(&model, "MOE_NORM", 29, KvType::F32, shape);
        assert!(on < off, "{shape}: {on} launches fused, {off} apart");
        eprintln!(
            "{shape}: moe_combine_add_rms_norm_q8k == combine + add_rms_norm_q8k; launches {on} against {off}"
        );
    }
}

//! Routing, the expert plan and the combine on the GPU.

use super::*;

/// Routing and the plan in one launch (decode sizes: `route_plan_one_r` for
/// one row of up to 1,024 experts, else `route_plan_small`) against `route`
/// and the wide calls' plan: softmaxed logits, ids, weights and places, byte
/// for byte, with ties among the logits and some rows holding a NaN; and
/// rows without a NaN against a host top k.
#[test]
#[ignore = "needs a CUDA device (scripts/gpu.sh runs it with --include-ignored)"]
fn the_one_launch_route_and_plan_equal_the_separate_kernels() {
    if !gpu() {
        return;
    }
    let (_d, model) = synth("tiny-qwen3moe", GgmlType::Q8_0, 1);
    let cuda = Cuda::new(0, &model, false).unwrap();
    let mut rng = Rng::new(4);
    let mut cases = 0;
    let mut nans = 0;
    // One row on route_plan_one_r's registers (e <= 256; past that and for
    // rows with a NaN it runs route_one_warp's code), and on
    // route_plan_small's one-warp path (e past 1,024).
    let (mut regs, mut warp) = (0, 0);
    for e in [8usize, 128, 200, 256, 512, 1024, 2048] {
        // k = 32, the most one warp routes, on one row.
        for k in [1usize, 2, 8, 32] {
            for m in [1usize, 2, 3, 4, 16, 32] {
                if m * k > 256 || k > e || (k == 32 && m > 1) {
                    continue;
                }
                for pad in [1usize, 16] {
                    // Logits on a coarse grid, so equal values (ties) occur.
                    let mut lg: Vec<f32> = (0..m * e)
                        .map(|_| (rng.below(16) as f32 - 8.0) * 0.25)
                        .collect();
                    // Some rows hold a NaN (the sorted-lane shortcut falls
                    // back to the argmax rounds there).
                    if rng.below(4) == 0 {
                        lg[rng.below((m * e) as u64) as usize] = f32::NAN;
                        nans += 1;
                    }
                    let one = cuda.route_plan_host(&lg, m, k, pad, false).unwrap();
                    let sep = cuda.route_plan_host(&lg, m, k, pad, true).unwrap();
                    let fb = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(fb(&one.0), fb(&sep.0), "e={e} k={k} m={m}: softmax");
                    assert_eq!(one.1, sep.1, "e={e} k={k} m={m}: ids");
                    // A row holding a NaN may name -1 (a skipped pick: the
                    // argmax rounds do not order NaNs, on both paths alike);
                    // other rows name experts.
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
                    regs += usize::from(m == 1 && e <= 256);
                    warp += usize::from(m == 1 && e > 1024);
                }
            }
        }
    }
    assert!(
        cases > 100 && nans > 10,
        "too few cases: {cases} ({nans} with a NaN)"
    );
    assert!(
        regs > 20 && warp > 5,
        "too few one-row cases: {regs} on registers, {warp} on route_plan_small"
    );
    eprintln!(
        "{cases} routings equal (one launch, route + plan), {nans} with a NaN logit, \
         {regs} on route_plan_one_r's registers, {warp} on route_plan_small's one-warp path"
    );
}

/// The expert plan (`plan_count`, then `plan_place_wide`) against the host
/// reference, on random routings with skipped (-1) ids: places padded per
/// expert, pairs in token order, unused places -1. Pair counts of decode
/// sizes and of wide calls (300 to 4,097 rows of 1, 2 or 8 pairs: n up to
/// 32,776, so passes of 8,192 pairs whole and cut, and a last run of 32
/// cut, n odd among them), crowded experts (a third of the cases put every
/// pair on 4 experts), pads of 1, 16 and 32.
#[test]
#[ignore = "needs a CUDA device (scripts/gpu.sh runs it with --include-ignored)"]
fn the_plan_equals_the_host_reference() {
    if !gpu() {
        return;
    }
    let (_d, model) = synth("tiny-qwen3moe", GgmlType::Q8_0, 1);
    let cuda = Cuda::new(0, &model, false).unwrap();
    let mut rng = Rng::new(31);
    let mut cases = 0;
    for e in [8usize, 128, 256, 512, 2048] {
        for k in [1usize, 2, 8] {
            let small = [1usize, 2, 7, 8, 64, 100, 255, 256]
                .into_iter()
                .filter(|n| n % k == 0);
            let wide = [300usize, 1000, 1025, 2048, 4097].map(|rows| rows * k);
            for n in small.chain(wide) {
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
                    let got = cuda.plan_host(&ids, k, e, pad).unwrap();
                    assert_eq!(got, want, "plan: e={e} k={k} n={n} pad={pad}");
                    cases += 1;
                }
            }
        }
    }
    eprintln!("{cases} plans equal the host reference");
}

/// The MoE combine as an op (`moe_combine_host`): the call's kernel
/// (four columns a thread, `moe_combine4`, where the width allows) against
/// `moe_combine` (a thread a column), and each row of an m-row call against
/// that row alone, byte for byte, outputs NaN-poisoned; routed rows with
/// skipped (-1) slots, with and without a shared expert, widths that take
/// the four-column kernel and one that does not (10). Without a shared
/// expert, also against a host reference (f32 fmas in slot order: the
/// kernel's function, so a wrong order or a dropped term fails).
#[test]
#[ignore = "needs a CUDA device (scripts/gpu.sh runs it with --include-ignored)"]
fn moe_combine_rows_equal_single_rows_and_the_column_kernel() {
    if !gpu() {
        return;
    }
    let (_d, model) = synth("tiny-qwen3moe", GgmlType::Q4_K, 5);
    let cuda = Cuda::new(0, &model, false).unwrap();
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
                    let a = cuda
                        .moe_combine_host(&out, &slot, &wts, sh, m, k, d, false)
                        .unwrap();
                    let b = cuda
                        .moe_combine_host(&out, &slot, &wts, sh, m, k, d, true)
                        .unwrap();
                    assert!(
                        a.iter().all(|v| v.is_finite()),
                        "{what}: a poisoned output stayed"
                    );
                    assert!(same_bits(&a, &b), "{what}: moe_combine4 != moe_combine");
                    for r in 0..m {
                        let one = cuda
                            .moe_combine_host(
                                &out,
                                &slot[r * k..(r + 1) * k],
                                &wts[r * k..(r + 1) * k],
                                shared.then_some((&ys[r * d..(r + 1) * d], &gi[r..r + 1])),
                                1,
                                k,
                                d,
                                false,
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
    let combine = |out: &[f32], slot: &[i32], wts: &[f32], sh: Option<(&[f32], &[f32])>| {
        cuda.moe_combine_host(out, slot, wts, sh, 1, 2, 8, false)
    };
    assert!(combine(&out, &[0, 1], &wts, None).is_ok());
    assert!(combine(&out, &[0, 4], &wts, None).is_err());
    assert!(combine(&out, &[0], &wts, None).is_err());
    assert!(combine(&out[..7], &[0, 1], &wts, None).is_err());
    assert!(combine(&out, &[0, 1], &wts, Some((&out[..7], &wts[..1]))).is_err());
    eprintln!("moe_combine4 == moe_combine == single rows on {cases} cases");
}

/// Prefill with the shared expert on the second stream, beside the routed
/// experts (calls of more than 16 rows: chunks of 17, 64 and 100), against
/// chunks of 16 rows, where it runs after them on the main stream: every
/// logit byte-equal (the row contract makes the chunk size no matter), on
/// the shapes with a shared expert.
#[test]
#[ignore = "needs a CUDA device (scripts/gpu.sh runs it with --include-ignored)"]
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
        let cuda = Cuda::new(0, &model, false).unwrap();
        let mut rng = Rng::new(31);
        let toks: Vec<u32> = (0..300)
            .map(|_| rng.below(model.w.n_vocab as u64) as u32)
            .collect();
        let serial = all_logits(&cuda, &model, &toks, 16);
        assert!(
            serial.iter().all(|v| v.is_finite()),
            "{shape}: non-finite logits"
        );
        for chunk in [64usize, 100, 17] {
            let side = all_logits(&cuda, &model, &toks, chunk);
            assert_eq!(side.len(), serial.len());
            if let Some(i) = side
                .iter()
                .zip(&serial)
                .position(|(a, b)| a.to_bits() != b.to_bits())
            {
                panic!(
                    "{shape} chunk {chunk}: the overlapped shared expert differs at position {}",
                    i / model.w.n_vocab
                );
            }
            checked += 1;
        }
        eprintln!(
            "{shape}: shared expert on the second stream (chunks 64, 100, 17) == serial (16)"
        );
    }
    assert!(
        checked >= 6,
        "too few shapes with a shared expert: {checked} runs"
    );
}

//! Matmuls on the GPU: every format and kernel against its reference and single rows.

use super::*;

/// `m` random activation rows for `w` (normal, times 0.5) and, for an expert
/// stack, each row's expert: row r unused (-1) where r % every.0 == every.1,
/// else a random expert.
fn random_rows(
    rng: &mut Rng,
    w: &samesum_engine::model::weights::Matrix,
    m: usize,
    every: (usize, usize),
) -> (Vec<f32>, Option<Vec<i32>>) {
    let x: Vec<f32> = (0..m * w.cols).map(|_| rng.normal() * 0.5).collect();
    let ids = (w.n_mats > 1).then(|| {
        (0..m)
            .map(|r| {
                if r % every.0 == every.1 {
                    -1
                } else {
                    (rng.next_u64() % w.n_mats as u64) as i32
                }
            })
            .collect()
    });
    (x, ids)
}

/// Rows as the expert plan places them in wide calls: each matrix's rows
/// together (matrices in a random order, 1 to 70 rows each), then -1 rows
/// up to a multiple of 32, so tiles end in padding of 1 to 31 rows.
fn padded_plan_rows(
    rng: &mut Rng,
    w: &samesum_engine::model::weights::Matrix,
) -> (Vec<f32>, Vec<i32>) {
    let mut ids = Vec::new();
    let mut order: Vec<i32> = (0..w.n_mats as i32).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    for &e in order.iter().take(6) {
        let c = 1 + (rng.next_u64() % 70) as usize;
        ids.extend(std::iter::repeat_n(e, c));
        ids.resize(ids.len().div_ceil(32) * 32, -1);
    }
    let x: Vec<f32> = (0..ids.len() * w.cols)
        .map(|_| rng.normal() * 0.5)
        .collect();
    (x, ids)
}

/// The one-row decode kernels (`mm_*_1`, `mm_q4_k_lane*_1`) against the
/// 16-row tile kernels, byte for byte: every quantized matrix of a layer and
/// the head, every format, m = 1..16 with and without expert ids (unused -1
/// rows included), outputs NaN-poisoned; and the fused GLU kernels against
/// two tile-kernel matmuls and silu_mul.
#[test]
#[ignore = "needs a CUDA device (scripts/gpu.sh runs it with --include-ignored)"]
fn one_row_kernels_equal_the_tile_kernels() {
    if !gpu() {
        return;
    }
    let (mut checked, mut glu_checked) = (0, 0);
    for quant in samesum_cuda::FORMATS
        .iter()
        .copied()
        .filter(|t| !matches!(t, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16))
    {
        for shape in SHAPES {
            let (_d, model) = synth(shape, quant, 13);
            let cuda = Cuda::new(0, &model, false).unwrap();
            let l0 = &model.w.layers[0];
            let mut mats = vec![&l0.moe.gate, &l0.moe.up, &l0.moe.down, &model.w.output];
            match &l0.mixer {
                Mixer::Attention(a) => mats.extend([&a.q, &a.k, &a.v, &a.o]),
                Mixer::Linear(d) => mats.push(&d.out),
            }
            let mut rng = Rng::new(31);
            for w in mats {
                if matches!(w.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
                    continue;
                }
                for m in 1..=16 {
                    let (x, ids) = random_rows(&mut rng, w, m, (5, 2));
                    let one = cuda.matmul_host(w, &x, m, ids.as_deref(), 16).unwrap();
                    let tile = cuda
                        .matmul_reference_host(w, &x, m, ids.as_deref())
                        .unwrap();
                    assert!(
                        one.iter().all(|v| v.is_finite()),
                        "{shape} {}: non-finite",
                        w.name
                    );
                    assert!(
                        same_bits(&one, &tile),
                        "{shape} {} {:?} m={m}: one-row kernel != tile kernel",
                        w.name,
                        w.ty
                    );
                    checked += 1;
                }
            }
            // The fused GLU (gate, up and silu_mul in one launch) against
            // two matmuls and silu_mul.
            let mut glus = vec![(&l0.moe.gate, &l0.moe.up)];
            if let Some(sh) = &l0.moe.shared {
                glus.push((&sh.gate, &sh.up));
            }
            for (g, u) in glus {
                for m in 1..=16 {
                    let (x, ids) = random_rows(&mut rng, g, m, (5, 2));
                    let fused = cuda.glu_host(g, u, &x, m, ids.as_deref(), false).unwrap();
                    let apart = cuda.glu_host(g, u, &x, m, ids.as_deref(), true).unwrap();
                    assert!(
                        fused.iter().all(|v| v.is_finite()),
                        "{shape} {}: non-finite GLU",
                        g.name
                    );
                    assert!(
                        same_bits(&fused, &apart),
                        "{shape} {} {:?} m={m}: fused GLU != two matmuls and silu_mul",
                        g.name,
                        g.ty
                    );
                    glu_checked += 1;
                }
            }
        }
    }
    assert!(checked > 100, "too few cases: {checked}");
    assert!(glu_checked > 100, "too few GLU cases: {glu_checked}");
    eprintln!(
        "one-row matmul cases equal to the tile kernels: {checked}; fused GLU cases equal: {glu_checked}"
    );
}

/// The lane-row Q4_K kernels (a lane per weight row, `mm_q4_k_lane_*`; 16
/// rows a block for matrices of up to 4,096 rows, 32 for more) and the
/// one-row Q6_K head against the tile kernels, byte for byte: plain rows
/// with and without expert ids (unused rows among them), the fused GLU
/// against two tile-kernel matmuls and silu_mul, and rows of 18 blocks
/// (4,608 columns: two of the lane kernel's 16-block chunks) and of 2 (the
/// MoE down projection, where the block has two warps), on poisoned
/// outputs. The forward passes (decode against prefill) cover the grouped
/// projections and the MoE jobs.
#[test]
#[ignore = "needs a CUDA device (scripts/gpu.sh runs it with --include-ignored)"]
fn lane_row_matmuls_equal_the_tile_kernels() {
    if !gpu() {
        return;
    }
    let sh = shapes::Shape {
        hidden: 4608,
        expert_ff: 512,
        layers: 1,
        ..shapes::by_name("tiny-qwen3moe").unwrap()
    };
    let (_dir, model) = synth_shape(sh, GgmlType::Q4_K, 19);
    let cuda = Cuda::new(0, &model, false).unwrap();
    let l0 = &model.w.layers[0];
    let mut mats = vec![&l0.moe.gate, &l0.moe.up, &l0.moe.down];
    if let Mixer::Attention(a) = &l0.mixer {
        mats.extend([&a.q, &a.k, &a.v, &a.o]);
    }
    for w in &mats {
        assert_eq!(w.ty, GgmlType::Q4_K, "{}", w.name);
    }
    mats.push(&model.w.output);
    let mut rng = Rng::new(41);
    let (mut checked, mut glus, mut blocks) = (0, 0, std::collections::BTreeSet::new());
    for w in mats {
        blocks.insert(w.cols / 256);
        for m in [1, 2, 3, 5, 8, 16] {
            let (x, ids) = random_rows(&mut rng, w, m, (3, 1));
            let lane = cuda.matmul_host(w, &x, m, ids.as_deref(), 16).unwrap();
            let tile = cuda
                .matmul_reference_host(w, &x, m, ids.as_deref())
                .unwrap();
            assert!(lane.iter().all(|v| v.is_finite()), "{}: non-finite", w.name);
            assert!(
                same_bits(&lane, &tile),
                "{} {:?} m={m}: one-row kernel != tile kernel",
                w.name,
                w.ty
            );
            checked += 1;
        }
    }
    for m in [1, 2, 7, 16] {
        let (x, ids) = random_rows(&mut rng, &l0.moe.gate, m, (4, 2));
        let lane = cuda
            .glu_host(&l0.moe.gate, &l0.moe.up, &x, m, ids.as_deref(), false)
            .unwrap();
        let apart = cuda
            .glu_host(&l0.moe.gate, &l0.moe.up, &x, m, ids.as_deref(), true)
            .unwrap();
        assert!(lane.iter().all(|v| v.is_finite()), "non-finite GLU");
        assert!(
            same_bits(&lane, &apart),
            "m={m}: lane GLU != two matmuls and silu_mul"
        );
        glus += 1;
    }
    assert!(
        blocks.contains(&18) && blocks.contains(&2),
        "block counts covered: {blocks:?}"
    );
    eprintln!("one-row cases equal to the tile kernels: {checked} matmuls, {glus} GLUs");
}

/// A layer's input projections in one launch (`mm_*_multi_1`: attention q, k,
/// v; delta-net qkv, z, beta, alpha) against one matmul each, byte for byte,
/// every format, one row and a few rows.
#[test]
#[ignore = "needs a CUDA device (scripts/gpu.sh runs it with --include-ignored)"]
fn grouped_input_projections_equal_separate_matmuls() {
    if !gpu() {
        return;
    }
    use samesum_engine::model::weights::{DeltaBa, DeltaInput};
    let mut groups = 0;
    for quant in samesum_cuda::FORMATS
        .iter()
        .copied()
        .filter(|t| !matches!(t, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16))
    {
        for shape in SHAPES {
            let (_d, model) = synth(shape, quant, 29);
            let cuda = Cuda::new(0, &model, false).unwrap();
            let mut rng = Rng::new(3);
            for lw in &model.w.layers {
                let ws: Vec<&samesum_engine::model::weights::Matrix> = match &lw.mixer {
                    Mixer::Attention(a) => vec![&a.q, &a.k, &a.v],
                    Mixer::Linear(d) => match (&d.input, &d.ba) {
                        (DeltaInput::Split { qkv, z }, DeltaBa::Split { beta, alpha }) => {
                            vec![qkv, z, beta, alpha]
                        }
                        _ => continue,
                    },
                };
                for m in [1usize, 2, 5] {
                    let x: Vec<f32> = (0..m * ws[0].cols).map(|_| rng.normal()).collect();
                    let one = cuda.mm_group_host(&ws, &x, m, true).unwrap();
                    let sep = cuda.mm_group_host(&ws, &x, m, false).unwrap();
                    for ((w, p), q) in ws.iter().zip(&one).zip(&sep) {
                        assert!(
                            p.iter().all(|v| v.is_finite()),
                            "{shape} {}: non-finite",
                            w.name
                        );
                        assert!(
                            same_bits(p, q),
                            "{shape} {} {:?} m={m}: grouped != separate",
                            w.name,
                            w.ty
                        );
                    }
                    groups += 1;
                }
            }
        }
    }
    assert!(groups > 20, "too few groups: {groups}");
    eprintln!("{groups} grouped input projections equal to separate matmuls");
}

/// The float tile kernels (prefill's routers and gates: `mm_f32_tile_w8`,
/// `mm_f32_few` for a matrix of a few rows; up to 16 rows, the per-row
/// kernel's block-row form `mm_f32_1`) against the per-row float kernel and
/// against one-row calls, byte for byte, for many m, on the
/// routers of every tiny shape and a wider one (768 columns: the kernel's
/// two-step loop ends on a half step), poisoned outputs.
#[test]
#[ignore = "needs a CUDA device (scripts/gpu.sh runs it with --include-ignored)"]
fn float_tile_matmuls_equal_the_row_kernel_and_single_rows() {
    if !gpu() {
        return;
    }
    let mut shapes_: Vec<shapes::Shape> = named_shapes(SHAPES);
    shapes_.push(shapes::Shape {
        hidden: 768,
        layers: 1,
        experts: 64,
        ..shapes::by_name("tiny-qwen3moe").unwrap()
    });
    // The wide kernel's last stage of 128 columns a quarter full, and a
    // router of 40 rows (the tiny shapes' routers of at most 8 rows take
    // mm_f32_few): a second block of 32 rows mostly past the matrix.
    shapes_.push(shapes::Shape {
        hidden: 800,
        layers: 1,
        experts: 40,
        ..shapes::by_name("tiny-qwen3moe").unwrap()
    });
    let mut checked = 0;
    for sh in &shapes_ {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.gguf");
        write_model(
            &SynthOptions::new(sh.clone(), GgmlType::Q8_0, 13),
            &p,
            &mut |_, _| {},
        )
        .unwrap();
        let model = Model::load(&p).unwrap();
        let cuda = Cuda::new(0, &model, false).unwrap();
        let router = &model.w.layers[0].moe.router;
        assert_eq!(
            router.ty,
            GgmlType::F32,
            "{}: the router is not f32",
            sh.name
        );
        // The shared expert's one-row input gate (mm_f32_few) where the
        // shape has one.
        let mut mats = vec![router];
        let mut l0 = model.w.layers[0].moe.shared.iter();
        mats.extend(l0.next().map(|s| &s.gate_inp));
        let mut rng = Rng::new(17);
        for (w, m) in mats
            .iter()
            .flat_map(|w| [2, 8, 16, 17, 24, 33, 100, 257].map(|m| (*w, m)))
        {
            let (x, _) = random_rows(&mut rng, w, m, (7, 3));
            let tile = cuda.matmul_host(w, &x, m, None, 16).unwrap();
            let row = cuda.matmul_reference_host(w, &x, m, None).unwrap();
            assert!(
                tile.iter().all(|v| v.is_finite()),
                "{}: non-finite",
                sh.name
            );
            assert!(
                same_bits(&tile, &row),
                "{} m={m}: float tiles != per-row float kernel",
                sh.name
            );
            for r in [0, m / 2, m - 1] {
                let one = cuda
                    .matmul_host(w, &x[r * w.cols..(r + 1) * w.cols], 1, None, 16)
                    .unwrap();
                assert!(
                    same_bits(&one, &tile[r * w.rows..(r + 1) * w.rows]),
                    "{} m={m} row {r}: one-row call differs",
                    sh.name
                );
            }
            checked += 1;
        }
    }
    eprintln!("float tile matmul cases equal: {checked}");
}

/// The tensor-core matmul tiles of every quantized format against the dp4a
/// tile kernels and against one-row calls, byte for byte: expert stacks and plain matrices, rows of
/// several experts in one tile (unsorted, with unused -1 rows), many m, 16-
/// and 32-row tiles (for expert stacks, rows placed as a plan padding to 16
/// and to 32 places an expert).
#[test]
#[ignore = "needs a CUDA device (scripts/gpu.sh runs it with --include-ignored)"]
fn tensor_core_matmuls_equal_the_dp4a_kernels_and_single_rows() {
    if !gpu() {
        return;
    }
    let (mut checked, mut live_skipped) = (0, 0);
    // The tiny shapes have 256 columns (one weight block per row); a wider
    // one runs the kernels' block loop over several blocks (odd and even).
    let mut shapes_: Vec<shapes::Shape> = named_shapes(SHAPES);
    shapes_.push(shapes::Shape {
        hidden: 768,
        expert_ff: 512,
        layers: 1,
        ..shapes::by_name("tiny-qwen3moe").unwrap()
    });
    // Rows of 800 columns for the 32-value formats: 25 blocks, the last
    // stage of the tensor-core kernel's K loop a partial one.
    let q8_tail = shapes::Shape {
        hidden: 800,
        ..shapes::by_name("tiny-qwen3moe").unwrap()
    };
    for quant in samesum_cuda::FORMATS
        .iter()
        .copied()
        .filter(|t| !matches!(t, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16))
    {
        let extra = (quant.block_size() == 32).then_some(&q8_tail);
        for sh in shapes_.iter().chain(extra) {
            let shape = format!("{} x{}", sh.name, sh.hidden);
            let dir = tempfile::tempdir().unwrap();
            let p = dir.path().join("m.gguf");
            write_model(
                &SynthOptions::new(sh.clone(), quant, 11),
                &p,
                &mut |_, _| {},
            )
            .unwrap();
            let model = Model::load(&p).unwrap();
            let cuda = Cuda::new(0, &model, false).unwrap();
            let moe = &model.w.layers[0].moe;
            let mats: Vec<&samesum_engine::model::weights::Matrix> = vec![&moe.gate, &moe.down]
                .into_iter()
                .chain(match &model.w.layers[0].mixer {
                    Mixer::Attention(a) => vec![&a.q],
                    Mixer::Linear(d) => vec![&d.out],
                })
                .filter(|w| w.ty == quant)
                .collect();
            assert!(!mats.is_empty(), "{shape}: no {quant:?} matrix to test");
            let mut rng = Rng::new(5);
            for w in mats {
                // Random rows at several m, and for expert stacks the
                // plan's layout (tiles ending in padding).
                let mut cases: Vec<(Vec<f32>, Option<Vec<i32>>)> = [17, 33, 64, 100, 257]
                    .iter()
                    .map(|&m| random_rows(&mut rng, w, m, (7, 3)))
                    .collect();
                if w.n_mats > 1 {
                    let (x, ids) = padded_plan_rows(&mut rng, w);
                    cases.push((x, Some(ids)));
                }
                let pads: &[usize] = if w.n_mats > 1 { &[16, 32] } else { &[16] };
                for (x, ids) in &cases {
                    let m = x.len() / w.cols;
                    let dp = cuda.matmul_reference_host(w, x, m, ids.as_deref()).unwrap();
                    for &pad in pads {
                        let mut tc = cuda.matmul_host(w, x, m, ids.as_deref(), pad).unwrap();
                        // The 32-row Q4_K kernel leaves rows of id -1 as
                        // they were (NaN; other kernels write their zeros):
                        // such a row is all NaN or all zeros, and every
                        // other row is as the dp4a kernels'.
                        for r in 0..m {
                            if ids.as_ref().is_none_or(|v| v[r] >= 0) {
                                continue;
                            }
                            let row = &mut tc[r * w.rows..(r + 1) * w.rows];
                            if row.iter().all(|v| v.is_nan()) {
                                live_skipped += 1;
                                row.fill(0.0);
                            }
                        }
                        assert!(tc.iter().all(|v| v.is_finite()), "{}: non-finite", w.name);
                        assert!(
                            same_bits(&tc, &dp),
                            "{} m={m} pad {pad}: tensor cores != dp4a",
                            w.name
                        );
                        for r in [0, m / 2, m - 1] {
                            let one = cuda
                                .matmul_host(
                                    w,
                                    &x[r * w.cols..(r + 1) * w.cols],
                                    1,
                                    ids.as_ref().map(|v| &v[r..r + 1]),
                                    16,
                                )
                                .unwrap();
                            assert!(
                                same_bits(&one, &tc[r * w.rows..(r + 1) * w.rows]),
                                "{} m={m} row {r}: one-row call differs",
                                w.name
                            );
                        }
                        checked += 1;
                    }
                }
            }
        }
    }
    // The 32-row Q4_K kernel did leave rows unwritten (the expert cases
    // padded to 32 take it).
    assert!(live_skipped > 0, "no row of id -1 left unwritten");
    eprintln!("tensor-core matmul cases equal: {checked}; rows left unwritten: {live_skipped}");
}

/// Several Q4_K matrices in one tensor-core launch
/// (`mm_tc_q4_k_async32g_jobs`, `_jobs_live`) against one launch each, byte
/// for byte, with poisoned outputs: a delta net's four input projections
/// (beta and alpha of a few rows beside the wide ones), attention's q, k and
/// v, the shared expert's gate and up, and the routed experts' gate and up
/// on the plan's layout (tiles of one expert ending in padding rows, which
/// neither launch writes).
#[test]
#[ignore = "needs a CUDA device (scripts/gpu.sh runs it with --include-ignored)"]
fn tensor_core_jobs_equal_one_launch_each() {
    if !gpu() {
        return;
    }
    use samesum_engine::model::weights::{DeltaBa, DeltaInput, Matrix};
    let mut checked = 0;
    for name in ["tiny-qwen35moe", "tiny-qwen3moe"] {
        let sh = shapes::by_name(name).unwrap();
        let (_d, model) = synth_shape(sh, GgmlType::Q4_K, 61);
        let cuda = Cuda::new(0, &model, false).unwrap();
        let mut groups: Vec<(Vec<&Matrix>, bool)> = Vec::new();
        for layer in &model.w.layers {
            match &layer.mixer {
                Mixer::Attention(a) => groups.push((vec![&a.q, &a.k, &a.v], false)),
                Mixer::Linear(dn) => {
                    if let (DeltaInput::Split { qkv, z }, DeltaBa::Split { beta, alpha }) =
                        (&dn.input, &dn.ba)
                    {
                        groups.push((vec![qkv, z, beta, alpha], false));
                    }
                }
            }
            if let Some(sh) = &layer.moe.shared {
                groups.push((vec![&sh.gate, &sh.up], false));
            }
            groups.push((vec![&layer.moe.gate, &layer.moe.up], true));
        }
        assert!(groups.iter().any(|(ws, _)| ws.len() == 4) || name != "tiny-qwen35moe");
        let mut rng = Rng::new(67);
        for (ws, experts) in &groups {
            let w0 = ws[0];
            let cases: Vec<(Vec<f32>, Option<Vec<i32>>)> = if *experts {
                (0..2)
                    .map(|_| {
                        let (x, ids) = padded_plan_rows(&mut rng, w0);
                        (x, Some(ids))
                    })
                    .collect()
            } else {
                [64, 100, 257]
                    .iter()
                    .map(|&m| random_rows(&mut rng, w0, m, (7, 3)))
                    .collect()
            };
            for (x, ids) in cases {
                let m = x.len() / w0.cols;
                let joint = cuda
                    .tc_jobs_host(ws, &x, m, ids.as_deref())
                    .unwrap()
                    .unwrap_or_else(|| panic!("{name} {} m={m}: no joint launch", w0.name));
                for (w, y) in ws.iter().zip(&joint) {
                    for r in (0..m).filter(|&r| ids.as_ref().is_none_or(|v| v[r] >= 0)) {
                        assert!(
                            y[r * w.rows..(r + 1) * w.rows]
                                .iter()
                                .all(|v| v.is_finite()),
                            "{}: non-finite",
                            w.name
                        );
                    }
                    let one = cuda.matmul_host(w, &x, m, ids.as_deref(), 32).unwrap();
                    assert!(
                        same_bits(y, &one),
                        "{name} {} m={m}: the joint launch differs from its own launch",
                        w.name
                    );
                }
                checked += 1;
            }
        }
    }
    eprintln!("tensor-core joint launch cases equal: {checked}");
}

/// The Q8_0 activation blocks the matmuls read equal the CPU's
/// quantization (ggml's reference rule) bit for bit: quants and d, on
/// random rows with zero blocks, tiny and huge magnitudes and ties.
#[test]
#[ignore = "needs a CUDA device (scripts/gpu.sh runs it with --include-ignored)"]
fn q8_0_activations_equal_the_cpu_quantization() {
    if !gpu() {
        return;
    }
    let (_d, model) = synth("tiny-qwen3moe", GgmlType::Q8_0, 7);
    let cuda = Cuda::new(0, &model, false).unwrap();
    let mut rng = Rng::new(17);
    let (m, cols) = (37, 256);
    let mut x: Vec<f32> = (0..m * cols).map(|_| rng.normal() * 3.0).collect();
    x[..32].fill(0.0);
    for (i, v) in x[32..64].iter_mut().enumerate() {
        *v = (i as f32 - 16.0) * 0.5; // halves: ties in the rounding
    }
    for v in &mut x[64..96] {
        *v *= 1e-30;
    }
    for v in &mut x[96..128] {
        *v *= 1e30;
    }
    let gpu_q = cuda.quantize_q8_0_host(&x, m).unwrap();
    for (b, chunk) in x.chunks_exact(32).enumerate() {
        let want = samesum_quant::quantize::q8_0(chunk.try_into().unwrap());
        let got = &gpu_q[b * 36..(b + 1) * 36];
        let qs: Vec<u8> = want.qs.iter().map(|&q| q as u8).collect();
        assert_eq!(&got[..32], &qs[..], "block {b}: quants");
        let d = f32::from_le_bytes(got[32..36].try_into().unwrap());
        assert_eq!(d.to_bits(), want.d.to_f32().to_bits(), "block {b}: d");
    }
}

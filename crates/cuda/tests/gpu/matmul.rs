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

/// The one-row decode kernels (`mm_*_1`) against the 16-row tile kernels, byte
/// for byte: every quantized matrix of a layer and the head, every format,
/// m = 1..16 with and without expert ids (unused -1 rows included), outputs
/// NaN-poisoned; and the fused GLU kernels against two matmuls and silu_mul.
#[test]
fn one_row_kernels_equal_the_tile_kernels() {
    if !gpu() {
        return;
    }
    let (mut checked, mut glu_checked) = (0, 0);
    for quant in [
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::Q8_0,
    ] {
        for shape in SHAPES {
            let (_d, model) = synth(shape, quant, 13);
            let mut cuda = Cuda::new(0, &model, false).unwrap();
            let l0 = &model.w.layers[0];
            let mut mats = vec![&l0.moe.gate, &l0.moe.up, &l0.moe.down, &model.w.output];
            match &l0.mixer {
                Mixer::Attention(a) => mats.extend([&a.q, &a.k, &a.v, &a.o]),
                Mixer::Linear(d) => mats.push(&d.out),
            }
            let mut rng = Rng::new(31);
            for w in mats {
                if !matches!(
                    w.ty,
                    GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K | GgmlType::Q8_0
                ) {
                    continue;
                }
                for m in 1..=16 {
                    let (x, ids) = random_rows(&mut rng, w, m, (5, 2));
                    cuda.set_row_kernels(true);
                    let one = cuda.matmul_host(w, &x, m, ids.as_deref(), true).unwrap();
                    cuda.set_row_kernels(false);
                    let tile = cuda.matmul_host(w, &x, m, ids.as_deref(), true).unwrap();
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
                    cuda.set_row_kernels(true);
                    cuda.set_fused_glu(true);
                    let fused = cuda.glu_host(g, u, &x, m, ids.as_deref()).unwrap();
                    cuda.set_fused_glu(false);
                    let apart = cuda.glu_host(g, u, &x, m, ids.as_deref()).unwrap();
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

/// The lane-row Q4_K kernels (a lane per weight row, `mm_q4_k_lane_*`)
/// against the warp-row kernels they replace, byte for byte: plain rows with
/// and without expert ids (unused rows among them), the fused GLU, and rows of
/// 18 blocks (4,608 columns: two of the kernel's 16-block chunks) and of 2
/// (the MoE down projection, where the block has two warps), on poisoned
/// outputs. The forward passes (decode against prefill) cover the grouped
/// projections and the MoE jobs.
#[test]
fn lane_row_matmuls_equal_the_warp_row_kernels() {
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
    let mut cuda = Cuda::new(0, &model, false).unwrap();
    let l0 = &model.w.layers[0];
    let mut mats = vec![&l0.moe.gate, &l0.moe.up, &l0.moe.down];
    if let Mixer::Attention(a) = &l0.mixer {
        mats.extend([&a.q, &a.k, &a.v, &a.o]);
    }
    let mut rng = Rng::new(41);
    let (mut checked, mut glus, mut blocks) = (0, 0, std::collections::BTreeSet::new());
    for w in mats {
        assert_eq!(w.ty, GgmlType::Q4_K, "{}", w.name);
        blocks.insert(w.cols / 256);
        for m in [1, 2, 3, 5, 8, 16] {
            let (x, ids) = random_rows(&mut rng, w, m, (3, 1));
            cuda.set_lane_rows(true);
            let lane = cuda.matmul_host(w, &x, m, ids.as_deref(), true).unwrap();
            cuda.set_lane_rows(false);
            let warp = cuda.matmul_host(w, &x, m, ids.as_deref(), true).unwrap();
            assert!(lane.iter().all(|v| v.is_finite()), "{}: non-finite", w.name);
            assert!(
                same_bits(&lane, &warp),
                "{} m={m}: lane rows != warp rows",
                w.name
            );
            checked += 1;
        }
    }
    for m in [1, 2, 7, 16] {
        let (x, ids) = random_rows(&mut rng, &l0.moe.gate, m, (4, 2));
        cuda.set_lane_rows(true);
        let lane = cuda
            .glu_host(&l0.moe.gate, &l0.moe.up, &x, m, ids.as_deref())
            .unwrap();
        cuda.set_lane_rows(false);
        let warp = cuda
            .glu_host(&l0.moe.gate, &l0.moe.up, &x, m, ids.as_deref())
            .unwrap();
        assert!(lane.iter().all(|v| v.is_finite()), "non-finite GLU");
        assert!(same_bits(&lane, &warp), "m={m}: lane GLU != warp GLU");
        glus += 1;
    }
    assert!(
        blocks.contains(&18) && blocks.contains(&2),
        "block counts covered: {blocks:?}"
    );
    cuda.set_lane_rows(true);
    eprintln!("lane-row cases equal to the warp-row kernels: {checked} matmuls, {glus} GLUs");
}

/// A layer's input projections in one launch (`mm_*_multi_1`: attention q, k,
/// v; delta-net qkv, z, beta, alpha) against one matmul each, byte for byte,
/// every format, one row and a few rows.
#[test]
fn grouped_input_projections_equal_separate_matmuls() {
    if !gpu() {
        return;
    }
    use samesum_engine::model::weights::{DeltaBa, DeltaInput};
    let mut groups = 0;
    for quant in [
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::Q8_0,
    ] {
        for shape in SHAPES {
            let (_d, model) = synth(shape, quant, 29);
            let mut cuda = Cuda::new(0, &model, false).unwrap();
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

/// The MoE block with its rows gathered as Q8_K blocks (each token row
/// quantized once) against gathering f32 rows and quantizing those, byte for
/// byte, at decode and prefill sizes, with the fused GLU on and off.
#[test]
fn quantized_gather_equals_f32_gather() {
    if !gpu() {
        return;
    }
    for shape in SHAPES {
        let (_d, model) = synth(shape, GgmlType::Q4_K, 17);
        let mut cuda = Cuda::new(0, &model, false).unwrap();
        let dm = model.hp.n_embd;
        let mut rng = Rng::new(8);
        for m in [1, 2, 5, 17, 64, 300] {
            let x: Vec<f32> = (0..m * dm).map(|_| rng.normal()).collect();
            let xd = cuda.upload(&x).unwrap();
            let mut outs = Vec::new();
            for (q, glu) in [(true, true), (false, false), (true, false)] {
                cuda.set_quantized_gather(q);
                cuda.set_fused_glu(glu);
                let mut y = cuda.upload(&vec![f32::NAN; m * dm]).unwrap();
                cuda.moe(&model, &model.w.layers[0].moe, &xd, &mut y)
                    .unwrap();
                outs.push(cuda.download(&y).unwrap());
            }
            assert!(
                outs[0].iter().all(|v| v.is_finite()),
                "{shape} m={m}: non-finite"
            );
            for o in &outs[1..] {
                assert!(
                    same_bits(o, &outs[0]),
                    "{shape} m={m}: the quantized gather changed the MoE output"
                );
            }
        }
        eprintln!("{shape}: quantized gather == f32 gather, m up to 300");
    }
}

/// The register-tiled float kernel (prefill's routers and gates) against the
/// per-row float kernel and against one-row calls, byte for byte, for many m,
/// on the routers of every tiny shape and a wider one (768 columns: the
/// kernel's two-step loop ends on a half step), poisoned outputs.
#[test]
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
        let mut cuda = Cuda::new(0, &model, false).unwrap();
        let router = &model.w.layers[0].moe.router;
        assert_eq!(
            router.ty,
            GgmlType::F32,
            "{}: the router is not f32",
            sh.name
        );
        // The shared expert's one-row input gate (mm_f32_few under the
        // wide switch) where the shape has one.
        let mut mats = vec![router];
        let mut l0 = model.w.layers[0].moe.shared.iter();
        mats.extend(l0.next().map(|s| &s.gate_inp));
        let mut rng = Rng::new(17);
        for (w, m) in mats
            .iter()
            .flat_map(|w| [17, 24, 33, 100, 257].map(|m| (*w, m)))
        {
            let (x, _) = random_rows(&mut rng, w, m, (7, 3));
            cuda.set_float_tiles(true);
            cuda.set_switch("F32_WIDE", true).unwrap();
            let tile = cuda.matmul_host(w, &x, m, None, true).unwrap();
            cuda.set_switch("F32_WIDE", false).unwrap();
            let narrow = cuda.matmul_host(w, &x, m, None, true).unwrap();
            cuda.set_float_tiles(false);
            let row = cuda.matmul_host(w, &x, m, None, true).unwrap();
            assert!(
                tile.iter().all(|v| v.is_finite()),
                "{}: non-finite",
                sh.name
            );
            assert!(
                same_bits(&tile, &row),
                "{} m={m}: wide tiles != per-row float kernel",
                sh.name
            );
            assert!(
                same_bits(&narrow, &row),
                "{} m={m}: 4 x 16 tiles != per-row float kernel",
                sh.name
            );
            cuda.set_float_tiles(true);
            cuda.set_switch("F32_WIDE", true).unwrap();
            for r in [0, m / 2, m - 1] {
                let one = cuda
                    .matmul_host(w, &x[r * w.cols..(r + 1) * w.cols], 1, None, true)
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

/// The tensor-core matmul tiles against the dp4a kernels and against one-row
/// calls, byte for byte: expert stacks and plain matrices, rows of several
/// experts in one tile (unsorted, with unused -1 rows), many m.
#[test]
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
    for quant in [GgmlType::Q4_K, GgmlType::Q5_K] {
        for sh in &shapes_ {
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
            let mut cuda = Cuda::new(0, &model, false).unwrap();
            // Tensor cores for every matrix, however few its rows.
            cuda.set_switch("TC_SMALL", false).unwrap();
            // Async32 seven times: the mins sums on tensor cores (TC_MINS),
            // with padding groups skipped (TC_GROUPS), that at 8 warps a
            // block (TC_W8, Q4_K) or leaving rows of id -1 unwritten
            // (LIVE_ROWS, Q4_K), both of those with the copy offsets in
            // shared memory (TC_WSMEM, Q4_K), and by dp2a.
            for (tk, mins, groups, w8, live, ws) in [
                (TcKernel::Plain, true, false, false, false, false),
                (TcKernel::Pipelined, true, false, false, false, false),
                (TcKernel::Async, true, false, false, false, false),
                (TcKernel::Async32, true, false, false, false, false),
                (TcKernel::Async32, true, true, false, false, false),
                (TcKernel::Async32, true, true, true, false, false),
                (TcKernel::Async32, true, true, false, true, false),
                (TcKernel::Async32, true, true, false, false, true),
                (TcKernel::Async32, true, true, false, true, true),
                (TcKernel::Async32, false, false, false, false, false),
            ] {
                cuda.set_tc_kernel(tk);
                cuda.set_switch("TC_MINS", mins).unwrap();
                cuda.set_switch("TC_GROUPS", groups).unwrap();
                cuda.set_switch("TC_W8", w8).unwrap();
                cuda.set_switch("LIVE_ROWS", live).unwrap();
                cuda.set_switch("TC_WSMEM", ws).unwrap();
                let kind =
                    format!("{tk:?} mins-mma={mins} groups={groups} w8={w8} live={live} ws={ws} ");
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
                    for (x, ids) in cases {
                        let m = x.len() / w.cols;
                        let mut tc = cuda.matmul_host(w, &x, m, ids.as_deref(), true).unwrap();
                        let dp = cuda.matmul_host(w, &x, m, ids.as_deref(), false).unwrap();
                        // With LIVE_ROWS the 32-row Q4_K kernel leaves rows
                        // of id -1 as they were (NaN; other kernels write
                        // their zeros): such a row is all NaN or all zeros,
                        // and every other row is as the dp4a kernels'.
                        if live {
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
                        }
                        assert!(tc.iter().all(|v| v.is_finite()), "{}: non-finite", w.name);
                        assert!(
                            same_bits(&tc, &dp),
                            "{} m={m}: {kind}tensor cores != dp4a",
                            w.name
                        );
                        for r in [0, m / 2, m - 1] {
                            let one = cuda
                                .matmul_host(
                                    w,
                                    &x[r * w.cols..(r + 1) * w.cols],
                                    1,
                                    ids.as_ref().map(|v| &v[r..r + 1]),
                                    true,
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
    // The live arm did leave rows unwritten (the plan-layout cases take the
    // 32-row kernel).
    assert!(live_skipped > 0, "LIVE_ROWS left no row of id -1 unwritten");
    eprintln!("tensor-core matmul cases equal: {checked}; rows left unwritten: {live_skipped}");
}

/// Several Q4_K matrices in one tensor-core launch (`TC_JOBS`:
/// `mm_tc_q4_k_async32g_jobs`) against one launch each, byte for byte, with
/// poisoned outputs: a delta net's four input projections (beta and alpha
/// of a few rows beside the wide ones), attention's q, k and v, the shared
/// expert's gate and up, and the routed experts' gate and up on the plan's
/// layout (tiles of one expert ending in padding rows); and the logits with
/// the switch on and off. The jobs kernels with their copy offsets in shared
/// memory (`TC_WSMEM`) against the default jobs kernels the same way.
#[test]
fn tensor_core_jobs_equal_one_launch_each() {
    if !gpu() {
        return;
    }
    use samesum_engine::model::weights::{DeltaBa, DeltaInput, Matrix};
    let mut checked = 0;
    for name in ["tiny-qwen35moe", "tiny-qwen3moe"] {
        let sh = shapes::by_name(name).unwrap();
        let (_d, model) = synth_shape(sh, GgmlType::Q4_K, 61);
        let mut cuda = Cuda::new(0, &model, false).unwrap();
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
                cuda.set_switch("TC_JOBS", true).unwrap();
                let joint = cuda
                    .tc_jobs_host(ws, &x, m, ids.as_deref())
                    .unwrap()
                    .unwrap_or_else(|| panic!("{name} {} m={m}: no joint launch", w0.name));
                // The jobs kernels with the copy offsets in shared memory
                // (`TC_WSMEM`): the same bytes as the default jobs kernels.
                cuda.set_switch("TC_WSMEM", true).unwrap();
                let joint_ws = cuda
                    .tc_jobs_host(ws, &x, m, ids.as_deref())
                    .unwrap()
                    .unwrap_or_else(|| panic!("{name} {} m={m}: no joint launch", w0.name));
                cuda.set_switch("TC_WSMEM", false).unwrap();
                for (w, (a, b)) in ws.iter().zip(joint.iter().zip(&joint_ws)) {
                    assert!(
                        same_bits(a, b),
                        "{name} {} m={m}: TC_WSMEM differs from the jobs kernel",
                        w.name
                    );
                }
                cuda.set_switch("TC_JOBS", false).unwrap();
                assert!(
                    cuda.tc_jobs_host(ws, &x, m, ids.as_deref())
                        .unwrap()
                        .is_none(),
                    "the switch is off"
                );
                for (w, y) in ws.iter().zip(&joint) {
                    assert!(y.iter().all(|v| v.is_finite()), "{}: non-finite", w.name);
                    let one = cuda.matmul_host(w, &x, m, ids.as_deref(), true).unwrap();
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
    assert_switch_keeps_logits(
        named_shapes(SHAPES),
        |s| s.name.to_string(),
        (71, 73),
        "TC_JOBS",
        &[300],
        "joint and separate tensor-core launches",
    );
    assert_switch_keeps_logits(
        named_shapes(SHAPES),
        |s| s.name.to_string(),
        (79, 83),
        "TC_WSMEM",
        &[300],
        "the jobs kernels with their copy offsets in shared memory",
    );
}

/// Every tiny shape, and the named ones with experts (and shared experts)
/// 768 wide: three 256-blocks a GLU row.
fn wide_glu_shapes(names: &[&str]) -> Vec<shapes::Shape> {
    let mut shapes: Vec<shapes::Shape> =
        SHAPES.iter().map(|s| shapes::by_name(s).unwrap()).collect();
    for s in names {
        let base = shapes::by_name(s).unwrap();
        shapes.push(shapes::Shape {
            expert_ff: 768,
            shared_ff: if base.shared_ff > 0 { 768 } else { 0 },
            ..base
        });
    }
    shapes
}

/// Wide calls of plain matrices under 128 rows on the dp4a kernels
/// (`TC_SMALL`; the delta nets' beta and alpha) against tensor cores: the
/// same logits bytes.
#[test]
fn small_matrices_on_dp4a_keep_the_logits() {
    if !gpu() {
        return;
    }
    let cases = named_shapes(&["tiny-qwen3next", "tiny-qwen35moe"]);
    for sh in &cases {
        let hv = sh.delta.unwrap().value_heads;
        assert!(hv < 128, "{}: beta has {hv} rows", sh.name);
    }
    assert_switch_keeps_logits(
        cases,
        |s| s.name.to_string(),
        (47, 53),
        "TC_SMALL",
        &[17, 64, 300],
        "dp4a and tensor-core small matrices",
    );
}

/// The 8-warp tensor-core kernel (`TC_W8`) against the 4-warp one: the same
/// logits bytes in prefill (chunks of 300 take 32-row tiles on every tiny
/// shape's experts and projections).
#[test]
fn eight_warp_tensor_core_tiles_keep_the_logits() {
    if !gpu() {
        return;
    }
    assert_switch_keeps_logits(
        named_shapes(SHAPES),
        |s| s.name.to_string(),
        (79, 83),
        "TC_W8",
        &[64, 300],
        "8-warp and 4-warp tensor-core tiles",
    );
}

/// The GLU output's products and Q8_K blocks a warp per 256-block
/// (`silu_mul_q8k_w`, `SILU_WARP`) against a block per row: the same logits
/// bytes in wide calls, at expert widths of one 256-block and of three.
#[test]
fn warp_glu_quantization_equals_the_row_kernel() {
    if !gpu() {
        return;
    }
    assert_switch_keeps_logits(
        wide_glu_shapes(&["tiny-qwen3moe", "tiny-qwen35moe"]),
        |s| format!("{} expert_ff {}", s.name, s.expert_ff),
        (41, 43),
        "SILU_WARP",
        &[17, 64, 300],
        "silu_mul_q8k_w and silu_mul_q8k",
    );
}

/// The GLU's products quantized from registers without storing them
/// (`silu_mul_q8k_wr`, `SILU_REGS`) against silu_mul_q8k_w, which stores
/// them and quantizes what it stored: the same logits bytes in wide calls,
/// at expert widths of one 256-block and of three.
#[test]
fn register_glu_quantization_equals_the_stored_rows() {
    if !gpu() {
        return;
    }
    assert_switch_keeps_logits(
        wide_glu_shapes(&["tiny-qwen3moe", "tiny-qwen35moe"]),
        |s| format!("{} expert_ff {}", s.name, s.expert_ff),
        (59, 61),
        "SILU_REGS",
        &[17, 64, 300],
        "silu_mul_q8k_wr and silu_mul_q8k_w",
    );
}

/// Wide routed calls that leave the rows with no expert unwritten
/// (`LIVE_ROWS`: the tensor-core `_live` kernels and `silu_mul_q8k_wl`)
/// against writing every row: the same logits bytes (chunks of 17 already
/// pad each expert's rows to the tensor-core tile), at expert widths of one
/// 256-block and of three.
#[test]
fn live_rows_keep_the_logits() {
    if !gpu() {
        return;
    }
    assert_switch_keeps_logits(
        wide_glu_shapes(&["tiny-qwen3moe", "tiny-qwen35moe"]),
        |s| format!("{} expert_ff {}", s.name, s.expert_ff),
        (89, 97),
        "LIVE_ROWS",
        &[17, 64, 300],
        "live rows and every row",
    );
}

/// One-row Q4_K matmuls on 16 rows a block (`LANE16`) against 32 (every
/// tiny shape's matrices are small enough to take it).
#[test]
fn lane_kernel_on_16_rows_a_block_changes_no_byte() {
    if !gpu() {
        return;
    }
    decode_switch_changes_no_byte("LANE16", (47, 11, 60), &[1, 7], |_, _, _| {});
}

/// The output head of a one-row call on the wide kernel (`HEAD_R4`:
/// `mm_q6_k_r4` / `mm_q8_0_r4`, four weight rows a warp) and on mm_row four
/// rows a warp (`HEAD_X4`: `mm_q6_k_1x4` / `mm_q8_0_1x4`), each against the
/// one-row kernel (`mm_q6_k_1` / `mm_q8_0_1`): the same logits bytes at
/// every position, replayed (the head's one-row calls) and in chunks of 64
/// and 7, on vocabularies past `HEAD_R4_ROWS` (40,000 rows are 2,500 blocks
/// of 16 exactly; with 40,001 the last block has one live row): a Q4_K
/// model's Q6_K head and a Q8_0 model's Q8_0 head, rows of one block and
/// of eight.
#[test]
fn output_head_on_the_wide_kernel_keeps_the_logits() {
    if !gpu() {
        return;
    }
    // Hidden 2,048 as the real models' (eight Q6_K blocks a row: the
    // double-buffered loads run) and 256 (one block).
    for (name, quant, vocab, hidden) in [
        ("tiny-qwen3moe", GgmlType::Q4_K, 40_000u32, 256u32),
        ("tiny-qwen3moe", GgmlType::Q8_0, 40_001, 256),
        ("tiny-qwen35moe", GgmlType::Q4_K, 40_001, 256),
        ("tiny-qwen35moe", GgmlType::Q4_K, 40_001, 2048),
    ] {
        assert!(vocab as usize >= samesum_cuda::backend::HEAD_R4_ROWS);
        let shape = shapes::Shape {
            vocab: Some(vocab),
            hidden,
            ..shapes::by_name(name).unwrap()
        };
        let (_d, model) = synth_shape(shape, quant, 59);
        let toks = test_tokens(&model, 29);
        let what = format!("{name} {quant:?} vocab {vocab} hidden {hidden}");
        for switch in ["HEAD_R4", "HEAD_X4"] {
            let (on, off) = switch_arms(&model, switch);
            let p = assert_same_logits(
                &on,
                &off,
                &model,
                &toks,
                &[1, 64, 7],
                &format!("{what}: {switch} on and off differ"),
            );
            assert!(
                same_bits(&p[0], &p[1]),
                "{what} {switch}: batched != replay"
            );
        }
        eprintln!(
            "{what}: the head on mm_*_r4, on mm_*_1x4 and on mm_*_1 equal, replayed and in chunks"
        );
    }
}

/// One-row Q6_K calls eight lanes a block (`Q6_LANES8`: `mm_q6_k8_1`, both
/// nibbles of a ql byte in one lane, unsigned values and the Q8_K block
/// sums) against sixteen (`mm_q6_k_1`): the same logits bytes at every
/// position, replayed (the one-row calls) and in chunks of 64 and 7, on a
/// Q4_K model's Q6_K head (hidden 256: one block a row, and 2,048: eight,
/// two passes of four blocks) and on a Q6_K model, whose every dense
/// matrix is Q6_K.
#[test]
fn q6_k_rows_eight_lanes_a_block_keep_the_logits() {
    if !gpu() {
        return;
    }
    for (name, quant, hidden) in [
        ("tiny-qwen35moe", GgmlType::Q4_K, 256u32),
        ("tiny-qwen35moe", GgmlType::Q4_K, 2048),
        ("tiny-qwen3moe", GgmlType::Q6_K, 256),
        ("tiny-qwen3next", GgmlType::Q6_K, 256),
    ] {
        let shape = shapes::Shape {
            hidden,
            ..shapes::by_name(name).unwrap()
        };
        let (_d, model) = synth_shape(shape, quant, 67);
        let toks = test_tokens(&model, 71);
        let what = format!("{name} {quant:?} hidden {hidden}");
        let (on, off) = switch_arms(&model, "Q6_LANES8");
        let p = assert_same_logits(
            &on,
            &off,
            &model,
            &toks,
            &[1, 64, 7],
            &format!("{what}: Q6_LANES8 on and off differ"),
        );
        assert!(same_bits(&p[0], &p[1]), "{what}: batched != replay");
        eprintln!(
            "{what}: one-row Q6_K calls on 8 and 16 lanes a block equal, replayed and in chunks"
        );
    }
}

/// The decode MoE's lane GLU writing its outputs' Q8_K rows
/// (`mm_q4_k_lane_moe_glu_q8k_1`: the last block per 256 columns quantizes
/// them) against the GLU and a quantize launch: the same logits bytes at
/// every position, replayed (graph replays reuse the counters) and in
/// chunks, on every tiny shape and on expert widths of 768 (three counters
/// a row, as qwen3moe's), and fewer launches. Against the defaults (where
/// `DOWN_QIN` already quantizes inside the down projection, so neither arm
/// has a quantize launch) only the bytes are compared; the launch count is
/// taken with `DOWN_QIN` off in both arms, against the quantize launch.
#[test]
fn glu_output_quantization_in_the_glu_equals_a_quantize_launch() {
    if !gpu() {
        return;
    }
    for shape in wide_glu_shapes(&["tiny-qwen3moe", "tiny-qwen3next"]) {
        let what = format!("{} expert_ff {}", shape.name, shape.expert_ff);
        let (_d, model) = synth_shape(shape, GgmlType::Q4_K, 43);
        let (on, off) = fusion_arms(&model, "GLU_Q8K", 13, KvType::F32, &what);
        assert!(
            on <= off,
            "{what}: {on} launches fused, {off} with DOWN_QIN"
        );
        let (on, off) = fusion_arms_with(
            &model,
            "GLU_Q8K",
            &[("DOWN_QIN", false)],
            13,
            KvType::F32,
            &format!("{what}, DOWN_QIN off"),
        );
        assert!(
            on < off,
            "{what}, DOWN_QIN off: {on} launches fused, {off} apart"
        );
        eprintln!("{what}: GLU with Q8_K rows == GLU + quantize_q8k; launches {on} against {off}");
    }
}

/// Decode's down projections quantizing the GLU's f32 rows themselves
/// (`DOWN_QIN`: `mm_q4_k_lane_moe_qin_1`, q8k_block into shared memory in
/// each block) against a quantize launch then `mm_q4_k_lane_moe_1`: the
/// same logits bytes at every position, replayed (graph replays too) and
/// in chunks, on every tiny shape (expert width 256: one block a row) and on
/// expert widths of 768 (three blocks a row, three warps quantizing), and
/// fewer launches.
#[test]
fn down_projections_quantizing_their_rows_equal_a_quantize_launch() {
    if !gpu() {
        return;
    }
    for shape in wide_glu_shapes(&["tiny-qwen3moe", "tiny-qwen35moe"]) {
        let what = format!("{} expert_ff {}", shape.name, shape.expert_ff);
        let (_d, model) = synth_shape(shape, GgmlType::Q4_K, 61);
        let (on, off) = fusion_arms(&model, "DOWN_QIN", 31, KvType::F32, &what);
        assert!(
            on < off,
            "{what}: {on} launches with the rows quantized in the down launch, {off} apart"
        );
        eprintln!(
            "{what}: down projections quantizing their rows == quantize_q8k + down; launches {on} against {off}"
        );
    }
}

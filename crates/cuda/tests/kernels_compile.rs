//! Every kernel module compiles with NVRTC for sm_90a, with no spills (but
//! for the kernels in `SPILLS_ALLOWED`, within their bounds); runs
//! wherever libnvrtc loads (CI installs it from PyPI), with no GPU needed.
//! Without NVRTC the test skips, unless `SAMESUM_REQUIRE` names `nvrtc`.

use samesum_cuda::compile::{self, MODULES};
use std::sync::Mutex;

/// Kernels allowed to spill, with the most bytes (stores and loads together
/// as ptxas reports them): the 32-row Q4_K tensor-core kernels run 3 blocks
/// an SM at 168 registers, keeping a few values a thread in local memory
/// (stored once per tile, read back at most a few times per 256-wide block
/// of K); the padding-skipping form holds four copies of the K loop (about
/// 296 bytes), as do its job-table and live-rows forms. The flash prefill
/// kernel at head dim 128 holds two m-tiles' outputs (128 registers) and
/// scores (64) a thread at the 255-register cap: NVRTC 13.0 keeps 24
/// bytes in local memory (24 bytes stored, 24 read), the form measured
/// against one m-tile a warp (H100, qwen3moe pp16384 +11.6%).
const SPILLS_ALLOWED: &[(&str, u32)] = &[
    ("attention_flash_128", 48),
    ("mm_tc_q4_k_async32g", 320),
    ("mm_tc_q4_k_async32g_jobs", 320),
    ("mm_tc_q4_k_async32g_live", 320),
    ("mm_tc_q4_k_async32g_jobs_live", 320),
];

/// NVRTC's log of one compile can pick up ptxas lines of another running at the
/// same time, so these tests compile one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

#[test]
fn every_module_compiles_for_sm_90a_without_spills() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !compile::nvrtc_present() {
        assert!(
            !std::env::var("SAMESUM_REQUIRE")
                .is_ok_and(|v| v.split(',').any(|w| w.trim() == "nvrtc")),
            "SAMESUM_REQUIRE names nvrtc but libnvrtc could not be loaded"
        );
        eprintln!("skipped: no libnvrtc");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // SAFETY: tests in this binary do not read the environment concurrently.
    unsafe { std::env::set_var("SAMESUM_KERNEL_CACHE", dir.path()) };
    // NVRTC (12.9 and later) keeps its own compile cache, and a compile
    // served from it has no ptxas report in its log: the second run of this
    // test on one machine failed that way. This turns it off.
    unsafe { std::env::set_var("CUDA_CACHE_DISABLE", "1") };
    let (maj, min) = compile::nvrtc_version().unwrap();
    eprintln!("NVRTC {maj}.{min}, arch {}", compile::DEFAULT_ARCH);
    eprintln!("| module | kernel | registers | stack bytes | spill bytes |");
    eprintln!("|---|---|---|---|---|");
    for (name, _) in MODULES {
        let c =
            compile::compile_module(name, compile::DEFAULT_ARCH).unwrap_or_else(|e| panic!("{e}"));
        assert!(!c.cached);
        assert!(
            c.cubin.len() > 1000,
            "{name}: cubin of {} bytes",
            c.cubin.len()
        );
        // SAMESUM_KEEP_CUBINS=DIR keeps each module's cubin for reading its
        // SASS (`cuobjdump -sass DIR/ops.cubin`).
        if let Some(keep) = std::env::var_os("SAMESUM_KEEP_CUBINS") {
            std::fs::create_dir_all(&keep).unwrap();
            std::fs::write(
                std::path::Path::new(&keep).join(format!("{name}.cubin")),
                &c.cubin,
            )
            .unwrap();
        }
        let res = c.resources();
        assert!(
            !res.is_empty(),
            "{name}: no ptxas report in the log:\n{}",
            c.log
        );
        for r in &res {
            eprintln!(
                "| {name} | {} | {} | {} | {} |",
                r.kernel, r.registers, r.stack, r.spills
            );
            let allowed = SPILLS_ALLOWED
                .iter()
                .find(|(k, _)| *k == r.kernel)
                .map_or(0, |a| a.1);
            assert!(
                r.spills <= allowed,
                "{name}: {} spills {} bytes (allowed {allowed})",
                r.kernel,
                r.spills
            );
        }
        // The second compile comes from the disk cache, byte for byte.
        let again = compile::compile_module(name, compile::DEFAULT_ARCH).unwrap();
        assert!(again.cached);
        assert_eq!(again.cubin, c.cubin);
    }
}

#[test]
fn a_kernel_that_does_not_compile_is_an_error_with_the_log() {
    let _one = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if !compile::nvrtc_present() {
        return;
    }
    let err = compile::nvrtc_compile(
        "broken",
        "extern \"C\" __global__ void k(float* x) { x[0] = undefined_name; }",
        &compile::options(compile::DEFAULT_ARCH),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("undefined_name"), "{err}");
}

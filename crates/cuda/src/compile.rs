//! Run-time compilation of the kernel sources with NVRTC, cached on disk.
//!
//! Each module's source is `common.cuh` followed by its `.cu` file (no include
//! path needed). It is compiled for one real architecture (sm_90a on the H200)
//! straight to a cubin, and the cubin is cached under
//! `$SAMESUM_KERNEL_CACHE` (default `$XDG_CACHE_HOME/samesum/kernels`, or
//! `~/.cache/samesum/kernels`), keyed by a hash of the source and options, the
//! NVRTC version and the architecture. `-Xptxas -v` puts the registers, stack
//! frame and spills of every kernel into the log, which [`Compiled::resources`]
//! parses.

use crate::error::{CudaError, Result};
use cudarc::nvrtc::sys;
use std::ffi::{CStr, CString, c_char};
use std::path::PathBuf;

/// The kernel sources shipped with the crate: (module name, source). A
/// module is one NVRTC compile unit made of one op family's files in order:
/// `matmul` the quantized and float matmuls (dp4a and one-row kernels, the
/// decode lane kernels, the tensor-core kernels, the float kernels with the
/// router); `ops` the row ops (norms and elementwise, attention, the conv
/// and delta rule, routing, the expert plan and combine).
pub const MODULES: &[(&str, &str)] = &[
    (
        "matmul",
        concat!(
            include_str!("../kernels/matmul_dp4a.cu"),
            include_str!("../kernels/matmul_nib.cu"),
            include_str!("../kernels/matmul_lowbit.cu"),
            include_str!("../kernels/matmul_lane.cu"),
            include_str!("../kernels/matmul_tc.cu"),
            include_str!("../kernels/matmul_float.cu"),
        ),
    ),
    (
        "ops",
        concat!(
            include_str!("../kernels/norm.cu"),
            include_str!("../kernels/attention.cu"),
            include_str!("../kernels/attention_flash.cu"),
            include_str!("../kernels/delta_net.cu"),
            include_str!("../kernels/moe.cu"),
        ),
    ),
];

/// The kernels a module's source defines, in source order: `extern "C"
/// __global__` functions (past an optional `__launch_bounds__(..)` or
/// `__maxnreg__(..)`), and the instances of the macros that define one from
/// their `name` parameter. [`crate::device::Device::open`] loads these.
pub fn kernels_defined(src: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (i, _) in src.match_indices("extern \"C\" __global__") {
        let mut rest = src[i..].split_once("__global__").unwrap().1.trim_start();
        rest = rest.strip_prefix("void").unwrap_or(rest).trim_start();
        for attr in ["__launch_bounds__(", "__maxnreg__("] {
            if let Some(r) = rest.strip_prefix(attr) {
                rest = r.split_once(')').unwrap().1.trim_start();
            }
        }
        let rest = rest.trim_start_matches(|c: char| c.is_whitespace() || c == '\\');
        let name: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if name != "name" {
            out.push(name); // `name` is a macro's parameter
        }
    }
    // Macros whose first parameter is `name` and whose body (the
    // backslash-continued lines) defines a kernel, then their uses.
    let lines: Vec<&str> = src.lines().collect();
    let mut macros = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some((mac, params)) = line
            .strip_prefix("#define ")
            .and_then(|r| r.split_once('('))
        else {
            continue;
        };
        let mut end = i;
        while lines[end].trim_end().ends_with('\\') && end + 1 < lines.len() {
            end += 1;
        }
        if params.trim_start().starts_with("name")
            && lines[i..=end].iter().any(|l| l.contains("__global__"))
        {
            macros.push(mac);
        }
    }
    for line in &lines {
        if let Some((mac, args)) = line.split_once('(')
            && macros.contains(&mac)
        {
            out.push(args.split(',').next().unwrap().trim().to_string());
        }
    }
    out
}

/// Shared helpers prepended to every module.
pub const COMMON: &str = include_str!("../kernels/common.cuh");

/// The architecture kernels are built for by default.
pub const DEFAULT_ARCH: &str = "sm_90a";

/// Whether the NVRTC library can be loaded (cudarc panics on first use when not).
pub fn nvrtc_present() -> bool {
    // SAFETY: only probes for the library with dlopen.
    unsafe { sys::is_culib_present() }
}

/// NVRTC's version, `(major, minor)`.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    if !nvrtc_present() {
        return Err(CudaError::NoLibrary("libnvrtc"));
    }
    let (mut a, mut b) = (0, 0);
    // SAFETY: two out-pointers to live integers.
    check(
        "nvrtcVersion",
        unsafe { sys::nvrtcVersion(&mut a, &mut b) },
        "",
    )?;
    Ok((a, b))
}

/// One compiled module.
#[derive(Clone, Debug)]
pub struct Compiled {
    /// Module name.
    pub name: String,
    /// The cubin.
    pub cubin: Vec<u8>,
    /// NVRTC's log (ptxas' resource lines included).
    pub log: String,
    /// Whether it came from the disk cache.
    pub cached: bool,
}

/// Registers and memory of one kernel, from ptxas' report.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resources {
    /// Kernel (mangled name as ptxas prints it).
    pub kernel: String,
    /// Registers per thread.
    pub registers: u32,
    /// Stack frame bytes.
    pub stack: u32,
    /// Spill stores + loads bytes.
    pub spills: u32,
}

impl Compiled {
    /// Per-kernel resources parsed from the log (empty when it came from the cache
    /// without a log).
    pub fn resources(&self) -> Vec<Resources> {
        let mut out = Vec::new();
        let mut cur: Option<Resources> = None;
        for line in self.log.lines() {
            if let Some(i) = line.find("Compiling entry function '") {
                let rest = &line[i + 26..];
                let name = rest.split('\'').next().unwrap_or("").to_string();
                cur = Some(Resources {
                    kernel: name,
                    registers: 0,
                    stack: 0,
                    spills: 0,
                });
            } else if let Some(r) = cur.as_mut() {
                if line.contains("bytes stack frame") {
                    let nums = numbers(line);
                    if nums.len() >= 3 {
                        r.stack = nums[0];
                        r.spills = nums[1] + nums[2];
                    }
                } else if line.contains("Used") && line.contains("registers") {
                    if let Some(&n) = numbers(line).first() {
                        r.registers = n;
                    }
                    out.push(cur.take().expect("set above"));
                }
            }
        }
        out
    }
}

fn numbers(line: &str) -> Vec<u32> {
    line.split(|c: char| !c.is_ascii_digit())
        .filter(|s| !s.is_empty())
        .filter_map(|s| s.parse().ok())
        .collect()
}

/// The options every module is compiled with.
pub fn options(arch: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "-std=c++17".into(),
        "-default-device".into(),
        "-Xptxas".into(),
        "-v".into(),
    ]
}

fn cache_dir() -> Option<PathBuf> {
    if let Ok(d) = std::env::var("SAMESUM_KERNEL_CACHE") {
        return (!d.is_empty()).then(|| PathBuf::from(d));
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("samesum").join("kernels"))
}

/// FNV-1a, 64 bits: a stable hash (std's hasher may change between releases).
fn fnv(parts: &[&[u8]]) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for p in parts {
        for &b in *p {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Compile module `name` (from [`MODULES`]) for `arch`, through the disk cache.
pub fn compile_module(name: &str, arch: &str) -> Result<Compiled> {
    let src = MODULES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, s)| *s)
        .ok_or_else(|| CudaError::Compile {
            module: name.into(),
            log: "no such module".into(),
        })?;
    let full = format!("{COMMON}\n{src}");
    let opts = options(arch);
    let (maj, min) = nvrtc_version()?;
    let key = fnv(&[full.as_bytes(), opts.join(" ").as_bytes()]);
    let file =
        cache_dir().map(|d| d.join(format!("{name}-{key:016x}-nvrtc{maj}.{min}-{arch}.cubin")));
    if let Some(f) = &file
        && let Ok(cubin) = std::fs::read(f)
        && !cubin.is_empty()
    {
        return Ok(Compiled {
            name: name.into(),
            cubin,
            log: String::new(),
            cached: true,
        });
    }
    let (cubin, log) = nvrtc_compile(name, &full, &opts)?;
    if let Some(f) = &file
        && let Some(dir) = f.parent()
        && std::fs::create_dir_all(dir).is_ok()
    {
        // Written whole, then renamed: a reader never sees half a cubin.
        let tmp = f.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, &cubin).is_ok() {
            let _ = std::fs::rename(&tmp, f);
        }
    }
    Ok(Compiled {
        name: name.into(),
        cubin,
        log,
        cached: false,
    })
}

/// Compile one source to a cubin, returning it with NVRTC's log.
pub fn nvrtc_compile(name: &str, src: &str, opts: &[String]) -> Result<(Vec<u8>, String)> {
    if !nvrtc_present() {
        return Err(CudaError::NoLibrary("libnvrtc"));
    }
    let csrc = CString::new(src).map_err(|_| CudaError::Compile {
        module: name.into(),
        log: "source contains a NUL byte".into(),
    })?;
    let cname = CString::new(format!("{name}.cu")).expect("module names have no NUL");
    let copts: Vec<CString> = opts
        .iter()
        .map(|o| CString::new(o.as_str()).expect("options have no NUL"))
        .collect();
    let ptrs: Vec<*const c_char> = copts.iter().map(|o| o.as_ptr()).collect();
    let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: the C strings outlive the program; the program is destroyed below.
    unsafe {
        check(
            "nvrtcCreateProgram",
            sys::nvrtcCreateProgram(
                &mut prog,
                csrc.as_ptr(),
                cname.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            ),
            name,
        )?;
        let res = sys::nvrtcCompileProgram(prog, ptrs.len() as i32, ptrs.as_ptr());
        let log = program_log(prog);
        let out = if res != sys::nvrtcResult::NVRTC_SUCCESS {
            Err(CudaError::Compile {
                module: name.into(),
                log: log.clone(),
            })
        } else {
            let mut n = 0usize;
            check(
                "nvrtcGetCUBINSize",
                sys::nvrtcGetCUBINSize(prog, &mut n),
                name,
            )
            .and_then(|_| {
                let mut buf = vec![0u8; n];
                check(
                    "nvrtcGetCUBIN",
                    sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut c_char),
                    name,
                )?;
                Ok((buf, log))
            })
        };
        sys::nvrtcDestroyProgram(&mut prog);
        out
    }
}

/// # Safety
/// `prog` must be a live program.
unsafe fn program_log(prog: sys::nvrtcProgram) -> String {
    let mut n = 0usize;
    // SAFETY: the caller passes a live program; the buffer has the size NVRTC gave.
    unsafe {
        if sys::nvrtcGetProgramLogSize(prog, &mut n) != sys::nvrtcResult::NVRTC_SUCCESS || n == 0 {
            return String::new();
        }
        let mut buf = vec![0u8; n];
        if sys::nvrtcGetProgramLog(prog, buf.as_mut_ptr() as *mut c_char)
            != sys::nvrtcResult::NVRTC_SUCCESS
        {
            return String::new();
        }
        CStr::from_bytes_until_nul(&buf)
            .map(|c| c.to_string_lossy().into_owned())
            .unwrap_or_default()
    }
}

fn check(what: &'static str, r: sys::nvrtcResult, module: &str) -> Result<()> {
    if r == sys::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(CudaError::Nvrtc {
            call: what,
            module: module.into(),
            code: format!("{r:?}"),
        })
    }
}

#[cfg(test)]
mod kernel_scan_tests {
    use super::{MODULES, kernels_defined};

    /// The scan finds both forms, so a kernel is loaded however it is defined.
    #[test]
    fn the_scan_sees_both_kernel_forms() {
        let src = "extern \"C\" __global__ void __launch_bounds__(256)\n    a_k(int x) {}\n\
                   extern \"C\" __global__ void b_k(int x) {}\n\
                   #define X_KERNEL(name, Q) \\\n    extern \"C\" __global__ void name(int x) {}\n\
                   X_KERNEL(c_k, 0)\n";
        assert_eq!(kernels_defined(src), ["a_k", "b_k", "c_k"]);
    }

    /// The attention module's flash kernels are found under their full names.
    #[test]
    fn the_flash_kernels_are_found() {
        let (_, src) = MODULES
            .iter()
            .find(|(m, _)| *m == "ops")
            .expect("ops module");
        let k = kernels_defined(src);
        for name in [
            "attention_flash_64",
            "attention_flash_128",
            "attention_flash_256",
            "attention_flash_combine",
        ] {
            assert!(k.iter().any(|n| n == name), "{name} not found in {k:?}");
        }
    }

    /// Every module defines kernels, each name once.
    #[test]
    fn every_module_defines_distinct_kernels() {
        for (module, src) in MODULES {
            let mut k = kernels_defined(src);
            assert!(k.len() > 10, "{module}: found only {k:?}");
            // A name cut short (a macro pasting it from pieces the scan
            // cannot follow) would fail the kernel's load at start-up.
            for name in &k {
                assert!(
                    !name.is_empty() && !name.ends_with('_'),
                    "{module}: kernel name {name:?} looks cut short"
                );
            }
            let n = k.len();
            k.sort();
            k.dedup();
            assert_eq!(k.len(), n, "{module}: a kernel defined twice");
        }
    }
}

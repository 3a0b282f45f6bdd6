//! The device: context, stream, the compiled kernels, and launch plumbing.
//!
//! One context and one stream per backend (event tracking off). Every kernel is looked up once by name; every launch and
//! copy error becomes a [`CudaError::Driver`] naming the kernel or copy.
//! Launches go through `cuLaunchKernelEx` (`Device::launch_raw`, the
//! `launch!` macro) so that, on Hopper, each may use programmatic dependent
//! launch; every kernel's first statement waits for its predecessor.

use crate::compile;
use crate::error::{CudaError, Result};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits,
};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::Mutex;

/// Whether the CUDA driver library can be loaded.
pub fn driver_present() -> bool {
    // SAFETY: only probes for the library with dlopen.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// The NCCL library's version (e.g. 22703 for 2.27.3) when it can be
/// loaded, else `None`: the collectives that several GPUs of one host would
/// exchange expert rows through. Probed with dlopen; nothing else is called
/// when it is missing.
pub fn nccl_version() -> Option<u32> {
    // SAFETY: only probes for the library with dlopen.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        return None;
    }
    cudarc::nccl::result::get_nccl_version()
        .ok()
        .map(|v| v.max(0) as u32)
}

/// Number of CUDA devices (0 when there is no driver).
pub fn device_count() -> usize {
    if !driver_present() {
        return 0;
    }
    CudaContext::device_count()
        .map(|n| n.max(0) as usize)
        .unwrap_or(0)
}

/// One timed launch: kernel name, start and end events.
type Timed = (&'static str, CudaEvent, CudaEvent);

/// A device with the kernels loaded.
pub struct Device {
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    /// A second stream for work that runs beside the main stream's (the
    /// shared expert in prefill; see [`Device::on_side`]).
    side: Arc<CudaStream>,
    /// Launches and allocations go to the lane's second stream while set.
    on_side: std::sync::atomic::AtomicBool,
    /// A second lane (main and second stream) for a prefill chunk that runs
    /// beside the one on `stream` (see [`Device::set_lane`]).
    lane1: (Arc<CudaStream>, Arc<CudaStream>),
    /// The lane launches, allocations and copies go to now (0 or 1).
    lane: std::sync::atomic::AtomicUsize,
    funcs: HashMap<String, CudaFunction>,
    /// The device's name.
    pub name: String,
    /// Per-kernel (registers, local bytes) as the driver reports them.
    pub resources: Vec<(String, i32, i32)>,
    /// With `SAMESUM_CUDA_PROFILE=1`: an event pair around every launch.
    prof: Option<Mutex<Vec<Timed>>>,
    /// Launches allow programmatic dependent launch (Hopper and later;
    /// `SAMESUM_CUDA_PDL=0` turns it off): a kernel may be scheduled while
    /// the one before it finishes, and waits (`griddepcontrol.wait`, the
    /// first statement of every kernel) until that one has completed and its
    /// writes are visible. No kernel reads or writes anything before its
    /// predecessor is done; what overlaps is the launch, and the waiting
    /// blocks hold their SM resources meanwhile (why only small calls use it:
    /// [`Device::rows_in_call`]).
    pdl: std::sync::atomic::AtomicBool,
    /// The rows of the current forward call (see [`Device::rows_in_call`]).
    /// (One a lane.)
    call_rows: [std::sync::atomic::AtomicUsize; 2],
    /// Kernels launched so far on each lane (tests count launches).
    launches: [std::sync::atomic::AtomicU64; 2],
}

/// The largest forward call (rows) whose launches use programmatic dependent
/// launch ([`Device::rows_in_call`]).
pub const PDL_MAX_ROWS: usize = 16;

/// The most parameters a kernel here takes (the launch keeps their pointers
/// in a fixed array).
const MAX_KERNEL_ARGS: usize = 24;

/// A kernel argument as the driver takes it: a device address (passed by
/// value) or a pointer to a scalar.
pub(crate) enum ArgSlot {
    Addr(u64),
    Val(*const std::ffi::c_void),
}

/// What a kernel launch can take as an argument.
pub(crate) trait KernelArg {
    fn slot(&self, stream: &CudaStream) -> ArgSlot;
}

macro_rules! scalar_arg {
    ($($t:ty),*) => {$(
        impl KernelArg for $t {
            fn slot(&self, _: &CudaStream) -> ArgSlot {
                ArgSlot::Val(self as *const $t as *const std::ffi::c_void)
            }
        }
    )*};
}
scalar_arg!(i32, u32, i64, u64, f32);

/// Up to four matrices of one format against the same rows in one launch
/// (`MmJobs` in kernels/matmul_dp4a.cu: weight addresses, output addresses, row
/// counts, how many are used).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct MmJobs {
    pub w: [u64; 4],
    pub y: [u64; 4],
    pub rows: [i32; 4],
    pub nj: i32,
}

/// A decode MoE's routed and shared experts in one launch (`MoeJobs` in
/// kernels/matmul_dp4a.cu: per job the gate (or only) and up weight bases, the
/// matrix stride, the per-row expert ids (0: none), the quantized input
/// rows, the outputs, each output row's input row (0: row r reads row r),
/// the rows per matrix and the input rows).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct MoeJobs {
    pub wg: [u64; 2],
    pub wu: [u64; 2],
    pub stride: [i64; 2],
    pub mats: [u64; 2],
    pub a: [u64; 2],
    pub y: [u64; 2],
    pub amap: [u64; 2],
    pub rows: [i32; 2],
    pub m: [i32; 2],
}

impl KernelArg for MoeJobs {
    fn slot(&self, _: &CudaStream) -> ArgSlot {
        ArgSlot::Val(self as *const MoeJobs as *const std::ffi::c_void)
    }
}

/// The rotary embedding by value (`RopeP` in kernels/attention.cu; the
/// engine's `Rope` without its dims).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct RopeArg {
    pub theta: f32,
    pub freq_scale: f32,
    pub ext_factor: f32,
    pub corr_lo: f32,
    pub corr_hi: f32,
    pub mscale: f32,
}

impl KernelArg for RopeArg {
    fn slot(&self, _: &CudaStream) -> ArgSlot {
        ArgSlot::Val(self as *const RopeArg as *const std::ffi::c_void)
    }
}

impl KernelArg for MmJobs {
    fn slot(&self, _: &CudaStream) -> ArgSlot {
        ArgSlot::Val(self as *const MmJobs as *const std::ffi::c_void)
    }
}

impl<T> KernelArg for CudaSlice<T> {
    fn slot(&self, stream: &CudaStream) -> ArgSlot {
        use cudarc::driver::DevicePtr;
        ArgSlot::Addr(self.device_ptr(stream).0)
    }
}

impl<T> KernelArg for cudarc::driver::CudaView<'_, T> {
    fn slot(&self, stream: &CudaStream) -> ArgSlot {
        use cudarc::driver::DevicePtr;
        ArgSlot::Addr(self.device_ptr(stream).0)
    }
}

impl<T> KernelArg for cudarc::driver::CudaViewMut<'_, T> {
    fn slot(&self, stream: &CudaStream) -> ArgSlot {
        use cudarc::driver::DevicePtr;
        ArgSlot::Addr(self.device_ptr(stream).0)
    }
}

/// A byte progress bar (hidden unless `show`).
pub(crate) fn upload_bar(show: bool, total: u64, what: &str) -> indicatif::ProgressBar {
    let bar = if show {
        indicatif::ProgressBar::new(total)
    } else {
        indicatif::ProgressBar::hidden()
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(&format!(
            "{what} {{bar:40}} {{bytes}}/{{total_bytes}} {{bytes_per_sec}}"
        ))
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar
}

/// A buffer's device address.
pub(crate) fn addr<T>(dev: &Device, s: &CudaSlice<T>) -> u64 {
    use cudarc::driver::DevicePtr;
    s.device_ptr(&dev.stream).0
}

pub(crate) fn drv(op: impl Into<String>, e: impl std::fmt::Debug) -> CudaError {
    CudaError::Driver {
        op: op.into(),
        msg: format!("{e:?}"),
    }
}

impl Device {
    /// Open device `ordinal` and load every kernel module (compiled for its
    /// compute capability through the disk cache).
    pub fn open(ordinal: usize) -> Result<Device> {
        if !driver_present() {
            return Err(CudaError::NoLibrary("libcuda"));
        }
        let count = device_count();
        if ordinal >= count {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| drv("cuCtxCreate", e))?;
        // SAFETY: called right after creation, before any allocation or stream.
        unsafe { ctx.disable_event_tracking() };
        let (maj, min) = ctx
            .compute_capability()
            .map_err(|e| drv("compute capability", e))?;
        let arch = if (maj, min) == (9, 0) {
            compile::DEFAULT_ARCH.to_string()
        } else {
            format!("sm_{maj}{min}")
        };
        // Every stream at the lowest priority: which lane's blocks the
        // scheduler starts first never changes what they compute.
        let (low, _high) = cudarc::driver::result::stream::get_priority_range()
            .map_err(|e| drv("cuCtxGetStreamPriorityRange", e))?;
        let new = |p: i32| {
            ctx.new_stream_with_priority(p)
                .map_err(|e| drv("cuStreamCreateWithPriority", e))
        };
        let stream = new(low)?;
        let name = ctx.name().unwrap_or_else(|_| "CUDA device".into());
        let mut funcs = HashMap::new();
        let mut resources = Vec::new();
        for (m, src) in compile::MODULES {
            let c = compile::compile_module(m, &arch)?;
            let module = ctx
                .load_module(cudarc::nvrtc::Ptx::from_binary(c.cubin))
                .map_err(|e| drv(format!("load module {m}"), e))?;
            for k in compile::kernels_defined(src) {
                let k = k.as_str();
                let f = module
                    .load_function(k)
                    .map_err(|e| drv(format!("load kernel {k}"), e))?;
                resources.push((
                    k.to_string(),
                    f.num_regs().unwrap_or(-1),
                    f.local_size_bytes().unwrap_or(-1),
                ));
                // Up to 227 KiB of shared memory a block (the delta rule keeps a
                // head's state there); the default cap on the dynamic part is
                // 48 KiB. The cap covers static and dynamic together, so a
                // kernel with static arrays gets 227 KiB less those.
                let fixed = f.shared_size_bytes().unwrap_or(0).max(0);
                let _ = f.set_attribute(
                    cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    227 * 1024 - fixed,
                );
                // The 32-row tensor-core kernels run 3 blocks of ~66 KB an
                // SM (the Q6_K and Q8_0 ones 2 of 84-105 KB): ask for the largest
                // shared-memory split so the driver does not pick one that
                // fits fewer.
                if k.ends_with("_async32")
                    || k.ends_with("_async32g")
                    || k.ends_with("_async32g_jobs")
                    || k.starts_with("mm_tc_q6_k")
                    || k.starts_with("mm_tc_q8_0")
                    || k.starts_with("attention_flash_")
                {
                    let _ = f.set_attribute(
                        cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                        100,
                    );
                }
                funcs.insert(k.to_string(), f);
            }
        }
        let prof = (std::env::var("SAMESUM_CUDA_PROFILE").as_deref() == Ok("1"))
            .then(|| Mutex::new(Vec::new()));
        let side = new(low)?;
        let lane1 = (new(low)?, new(low)?);
        Ok(Device {
            ctx,
            stream,
            side,
            on_side: std::sync::atomic::AtomicBool::new(false),
            lane1,
            lane: std::sync::atomic::AtomicUsize::new(0),
            funcs,
            name: format!("{name} (cuda:{ordinal}, {arch})"),
            resources,
            prof,
            launches: Default::default(),
            pdl: std::sync::atomic::AtomicBool::new(
                maj >= 9 && std::env::var("SAMESUM_CUDA_PDL").as_deref() != Ok("0"),
            ),
            call_rows: [
                std::sync::atomic::AtomicUsize::new(1),
                std::sync::atomic::AtomicUsize::new(1),
            ],
        })
    }

    /// The next launches belong to a forward call of `m` rows: they use
    /// programmatic dependent launch only for `m` up to [`PDL_MAX_ROWS`].
    /// Every kernel lets its dependents launch right after its own wait, so
    /// the next kernel's blocks become resident as soon as this kernel's last
    /// blocks have started and wait on the SMs until it ends; in prefill,
    /// whose kernels run for hundreds of microseconds in one or a few waves,
    /// that cost qwen35moe pp4096 10% (H200: 12,980 against
    /// 14,485 tok/s without). Decode keeps it (~1% faster).
    /// Which launches use it never changes what they compute.
    pub(crate) fn rows_in_call(&self, m: usize) {
        self.call_rows[self.lane()].store(m, std::sync::atomic::Ordering::Relaxed);
    }

    /// Allow programmatic dependent launch (where the device has it) or not
    /// (tests compare against launches without it); the kernels compute the
    /// same bytes either way.
    pub fn set_pdl(&self, on: bool) {
        let (maj, _) = self.ctx.compute_capability().unwrap_or((0, 0));
        self.pdl
            .store(on && maj >= 9, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether launches may use programmatic dependent launch at all (the
    /// device has it, and `SAMESUM_CUDA_PDL` is not `0`).
    pub fn pdl_allowed(&self) -> bool {
        self.pdl.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether the next launch uses programmatic dependent launch.
    pub fn uses_pdl(&self) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        self.pdl_allowed() && self.call_rows[self.lane()].load(Relaxed) <= PDL_MAX_ROWS
    }

    /// Launch `name` with `cfg` and `args` on the stream.
    ///
    /// # Safety
    /// The arguments must match the kernel's signature in kernels/*.cu and
    /// every buffer must be sized for the grid.
    pub(crate) unsafe fn launch_raw(
        &self,
        name: &str,
        cfg: cudarc::driver::LaunchConfig,
        args: &[ArgSlot],
    ) -> Result<()> {
        use cudarc::driver::sys;
        let f = self.func(name)?;
        self.ctx.bind_to_thread().map_err(|e| drv(name, e))?;
        self.launches[self.lane()].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // One pointer per parameter, on the stack (no allocation per launch):
        // a device address is passed by pointing at it inside `args`.
        let mut params = [std::ptr::null_mut::<std::ffi::c_void>(); MAX_KERNEL_ARGS];
        if args.len() > MAX_KERNEL_ARGS {
            return Err(CudaError::Driver {
                op: name.into(),
                msg: format!(
                    "{} kernel arguments (at most {MAX_KERNEL_ARGS})",
                    args.len()
                ),
            });
        }
        for (p, a) in params.iter_mut().zip(args) {
            *p = match a {
                ArgSlot::Addr(addr) => addr as *const u64 as *mut std::ffi::c_void,
                ArgSlot::Val(v) => *v as *mut std::ffi::c_void,
            };
        }
        // SAFETY: plain C structs; zero is a valid value for every field.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let pdl = self.uses_pdl();
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.current().cu_stream(),
            attrs: &mut attr,
            numAttrs: u32::from(pdl),
        };
        // SAFETY: `params` points at one value per kernel parameter (the
        // caller's contract), alive until the call returns; the driver copies
        // them at launch.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                f.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(|e| drv(name, e))
    }

    /// How many kernels have been launched on lane `lane` so far.
    pub fn lane_launch_count(&self, lane: usize) -> u64 {
        self.launches[lane.min(1)].load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The lane launches go to now.
    pub(crate) fn lane(&self) -> usize {
        self.lane.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Send later launches, allocations and copies to lane `lane` (0 or 1):
    /// two chunks of one prefill run on the two lanes at once, ordered by
    /// events ([`Device::lane_event`], [`Device::wait_for`]). Lane 0's main
    /// stream is `stream`, where everything else runs.
    pub(crate) fn set_lane(&self, lane: usize) {
        self.lane
            .store(lane.min(1), std::sync::atomic::Ordering::Relaxed);
    }

    /// The current lane's main stream.
    fn main(&self) -> &Arc<CudaStream> {
        if self.lane() == 0 {
            &self.stream
        } else {
            &self.lane1.0
        }
    }

    /// An event recorded on the current lane's main stream now.
    pub(crate) fn lane_event(&self) -> Result<CudaEvent> {
        self.main()
            .record_event(Some(
                cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING,
            ))
            .map_err(|e| drv("cuEventRecord", e))
    }

    /// A timing event recorded on the stream now.
    fn mark(&self) -> Result<CudaEvent> {
        let ev = self
            .ctx
            .new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| drv("cuEventCreate", e))?;
        ev.record(&self.stream)
            .map_err(|e| drv("cuEventRecord", e))?;
        Ok(ev)
    }

    /// Start timing a launch (profiling only).
    pub(crate) fn prof_begin(&self) -> Result<Option<CudaEvent>> {
        match self.prof {
            Some(_) => self.mark().map(Some),
            None => Ok(None),
        }
    }

    /// Finish timing a launch of `name`.
    pub(crate) fn prof_end(&self, name: &'static str, start: Option<CudaEvent>) -> Result<()> {
        if let (Some(p), Some(s)) = (&self.prof, start) {
            let ev = self.mark()?;
            p.lock().expect("profile lock").push((name, s, ev));
        }
        Ok(())
    }

    /// Per kernel: (name, launches, total ms), largest first, over the launches
    /// since the last call; `None` when profiling is off.
    pub fn take_profile(&self) -> Result<Option<Vec<(String, usize, f64)>>> {
        let Some(p) = &self.prof else {
            return Ok(None);
        };
        self.sync()?;
        let recs = std::mem::take(&mut *p.lock().expect("profile lock"));
        let mut by: HashMap<&str, (usize, f64)> = HashMap::new();
        for (name, s, e) in &recs {
            let ms = s.elapsed_ms(e).map_err(|x| drv("cuEventElapsedTime", x))? as f64;
            let t = by.entry(name).or_default();
            t.0 += 1;
            t.1 += ms;
        }
        let mut out: Vec<(String, usize, f64)> = by
            .into_iter()
            .map(|(k, (n, ms))| (k.to_string(), n, ms))
            .collect();
        out.sort_by(|a, b| b.2.total_cmp(&a.2));
        Ok(Some(out))
    }

    pub(crate) fn func(&self, name: &str) -> Result<&CudaFunction> {
        self.funcs.get(name).ok_or_else(|| CudaError::Driver {
            op: name.into(),
            msg: "kernel not loaded".into(),
        })
    }

    /// The stream launches and allocations go to now.
    pub(crate) fn current(&self) -> &Arc<CudaStream> {
        if self.on_side.load(std::sync::atomic::Ordering::Relaxed) {
            self.side()
        } else {
            self.main()
        }
    }

    /// The current lane's second stream.
    fn side(&self) -> &Arc<CudaStream> {
        if self.lane() == 0 {
            &self.side
        } else {
            &self.lane1.1
        }
    }

    /// Run `f`'s launches on the current lane's second stream, after
    /// everything queued on its main stream so far, while later main-stream
    /// work goes on beside them; returns `f`'s result and an event the main
    /// stream must wait for before it reads anything `f` wrote. Buffers `f`
    /// allocates live on the second stream (their frees are ordered after
    /// its work); buffers it writes for the main stream must be allocated
    /// before the call.
    pub(crate) fn on_side<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<(T, CudaEvent)> {
        use cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING;
        use std::sync::atomic::Ordering::Relaxed;
        let start = self
            .main()
            .record_event(Some(CU_EVENT_DISABLE_TIMING))
            .map_err(|e| drv("cuEventRecord", e))?;
        self.side()
            .wait(&start)
            .map_err(|e| drv("cuStreamWaitEvent", e))?;
        self.on_side.store(true, Relaxed);
        let r = f();
        self.on_side.store(false, Relaxed);
        let done = self
            .side()
            .record_event(Some(CU_EVENT_DISABLE_TIMING))
            .map_err(|e| drv("cuEventRecord", e))?;
        Ok((r?, done))
    }

    /// Make the current lane's main stream wait for `ev` (from
    /// [`Device::on_side`] or [`Device::lane_event`]).
    pub(crate) fn wait_for(&self, ev: &CudaEvent) -> Result<()> {
        self.main()
            .wait(ev)
            .map_err(|e| drv("cuStreamWaitEvent", e))
    }

    /// A zeroed device buffer.
    pub(crate) fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>> {
        self.current()
            .alloc_zeros::<T>(n.max(1))
            .map_err(|e| drv(format!("alloc {n} elements"), e))
    }

    /// An uninitialized device buffer (every element is written before it is read).
    pub(crate) fn scratch<T: DeviceRepr>(&self, n: usize) -> Result<CudaSlice<T>> {
        // SAFETY: callers write every element before reading it.
        unsafe { self.current().alloc::<T>(n.max(1)) }
            .map_err(|e| drv(format!("alloc {n} elements"), e))
    }

    /// Copy a host slice to a new device buffer.
    pub(crate) fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>> {
        if host.is_empty() {
            return self.scratch(1);
        }
        self.current()
            .clone_htod(host)
            .map_err(|e| drv(format!("copy {} elements to the device", host.len()), e))
    }

    /// Copy a device buffer to the host (synchronizes the stream).
    pub(crate) fn download<T: DeviceRepr + Default + Clone>(
        &self,
        d: &CudaSlice<T>,
        n: usize,
    ) -> Result<Vec<T>> {
        if n > d.len() {
            return Err(drv(
                "copy to the host",
                format!("{n} values asked of a buffer of {}", d.len()),
            ));
        }
        if n == 0 {
            return Ok(Vec::new());
        }
        // The first n values only, into a vector the copy fills (no zero
        // fill first: 64 rows of a 248K vocabulary are 64 MB a step).
        self.main()
            .clone_dtoh(&d.slice(..n))
            .map_err(|e| drv("copy to the host", e))
    }

    /// Whether launches are being timed (`SAMESUM_CUDA_PROFILE=1`).
    pub(crate) fn profiling(&self) -> bool {
        self.prof.is_some()
    }

    /// Wait for everything queued so far; a kernel fault surfaces here.
    pub fn sync(&self) -> Result<()> {
        self.lane1
            .0
            .synchronize()
            .map_err(|e| drv("synchronize", e))?;
        self.stream.synchronize().map_err(|e| drv("synchronize", e))
    }
}

/// Launch kernel `$name` on `$dev` with config `$cfg`; the arguments must be
/// references to values that live past the statement.
macro_rules! launch {
    ($dev:expr, $name:expr, $cfg:expr, $($arg:expr),* $(,)?) => {
        $crate::device::launch_as!($dev, $name, $name, $cfg, $($arg),*)
    };
}
pub(crate) use launch;

/// `launch!` with the kernel profile's row for it named `$label` (a launch
/// kind finer than the kernel, e.g. a matmul's reduction length).
macro_rules! launch_as {
    ($dev:expr, $name:expr, $label:expr, $cfg:expr, $($arg:expr),* $(,)?) => {{
        let ev = $dev.prof_begin()?;
        let args = [$( $crate::device::KernelArg::slot(&*$arg, &$dev.stream) ),*];
        // SAFETY: the arguments match the kernel's signature in kernels/*.cu
        // (checked by the conformance tests on the GPU), and every buffer is
        // sized for the grid computed by the caller.
        unsafe { $dev.launch_raw($name, $cfg, &args) }
            .and_then(|_| $dev.prof_end($label, ev))
    }};
}
pub(crate) use launch_as;

/// A 1-D launch over `n` threads in blocks of 256.
pub(crate) fn cfg1(n: usize) -> cudarc::driver::LaunchConfig {
    cudarc::driver::LaunchConfig {
        grid_dim: ((n.max(1)).div_ceil(256) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A launch of `grid` blocks of `block` threads with `smem` dynamic shared bytes.
pub(crate) fn cfg(grid: (u32, u32, u32), block: u32, smem: u32) -> cudarc::driver::LaunchConfig {
    cudarc::driver::LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes: smem,
    }
}

/// Threads of a lane-row matmul block (`mm_q4_k_lane_*`): a warp per
/// 256-block of the row up to 16 (LANE_CH in matmul_lane.cu), so a warp computes
/// one block (two for a GLU) per 16 and short rows leave no warp idle (at
/// four warps, the out projections' 64 blocks of 16-block rows took 11.6 us
/// against the warp-row kernel's 6.6 on an H200).
pub(crate) fn lane_threads(nb: i32) -> u32 {
    32 * nb.clamp(1, 16) as u32
}

/// A lane-row launch: a block per 32 weight rows (grid x) per input row
/// (grid y).
pub(crate) fn lane_cfg(rows: usize, m: usize, nb: i32) -> cudarc::driver::LaunchConfig {
    lane_cfg_rows(rows, m, nb, 32)
}

/// A lane-row launch of `rb` weight rows a block (32, or 16 for
/// `mm_q4_k_lane16_1`).
pub(crate) fn lane_cfg_rows(
    rows: usize,
    m: usize,
    nb: i32,
    rb: usize,
) -> cudarc::driver::LaunchConfig {
    cfg((rows.div_ceil(rb) as u32, m as u32, 1), lane_threads(nb), 0)
}

#[cfg(test)]
mod layout_tests {
    /// `MmJobs` is passed by value to the kernels: its C layout must be the
    /// CUDA struct's (four pointers, four pointers, four ints, an int; 88
    /// bytes with the 8-byte alignment).
    #[test]
    fn mm_jobs_has_the_kernels_layout() {
        use std::mem::{align_of, offset_of, size_of};
        assert_eq!(size_of::<super::MmJobs>(), 88);
        assert_eq!(align_of::<super::MmJobs>(), 8);
        assert_eq!(offset_of!(super::MmJobs, y), 32);
        assert_eq!(offset_of!(super::MmJobs, rows), 64);
        assert_eq!(offset_of!(super::MmJobs, nj), 80);
    }

    /// `MoeJobs` likewise: seven pairs of 8-byte fields, then two pairs of
    /// ints (128 bytes, 8-byte aligned).
    #[test]
    fn moe_jobs_has_the_kernels_layout() {
        use std::mem::{align_of, offset_of, size_of};
        assert_eq!(size_of::<super::MoeJobs>(), 128);
        assert_eq!(align_of::<super::MoeJobs>(), 8);
        assert_eq!(offset_of!(super::MoeJobs, wu), 16);
        assert_eq!(offset_of!(super::MoeJobs, stride), 32);
        assert_eq!(offset_of!(super::MoeJobs, mats), 48);
        assert_eq!(offset_of!(super::MoeJobs, a), 64);
        assert_eq!(offset_of!(super::MoeJobs, y), 80);
        assert_eq!(offset_of!(super::MoeJobs, amap), 96);
        assert_eq!(offset_of!(super::MoeJobs, rows), 112);
        assert_eq!(offset_of!(super::MoeJobs, m), 120);
    }
}

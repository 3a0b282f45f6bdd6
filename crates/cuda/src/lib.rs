//! samesum's CUDA backend: kernels compiled at run time by NVRTC (cached on
//! disk), weights resident on the device, every op under the row contract.
//!
//! Nothing CUDA is needed to build this crate: the driver and NVRTC are loaded
//! at run time, and every entry point checks for them first and returns an
//! error (cudarc would panic) when they are missing.

pub mod backend;
pub mod compile;
pub mod device;
mod error;
pub mod tier;
mod tiered;

pub use backend::{Cuda, CudaBuf, CudaOptions, CudaState, FORMATS};
pub use device::{PDL_MAX_ROWS, device_count, driver_present, nccl_version};
pub use error::{CudaError, Result};
pub use tiered::TierStats;

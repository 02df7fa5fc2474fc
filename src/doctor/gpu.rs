//! The compute device: a CPU job needs nothing; a GPU job needs a CUDA build, the driver
//! (`libcuda.so.1`) with at least one device, and NCCL (`libnccl.so.2`).

use std::ffi::{c_int, c_uint, c_void, CStr};

use super::report::Line;
use crate::config::DeviceKind;

/// The CUDA driver library, as the CUDA runtime loads it.
const LIBCUDA: &CStr = c"libcuda.so.1";
/// NCCL, the collectives library GPU jobs use between devices.
const LIBNCCL: &CStr = c"libnccl.so.2";

/// `CUDA_ERROR_NO_DEVICE`: the driver loads but sees no device.
const CUDA_ERROR_NO_DEVICE: c_int = 100;
/// `CUDA_ERROR_STUB_LIBRARY`: what loaded is a link-time stub, not the driver.
const CUDA_ERROR_STUB_LIBRARY: c_int = 34;

/// `CUresult cuInit(unsigned int flags)`.
type CuInit = unsafe extern "C" fn(c_uint) -> c_int;
/// `CUresult cuDeviceGetCount(int *count)`.
type CuDeviceGetCount = unsafe extern "C" fn(*mut c_int) -> c_int;
type CuDriverGetVersion = unsafe extern "C" fn(*mut c_int) -> c_int;

/// The CUDA version `scripts/cuda-toolchain.sh` builds with (as the driver API numbers it).
const TOOLCHAIN_CUDA: c_int = 13000;

/// The lines of the device check.
pub(super) fn check_device(device: DeviceKind) -> Vec<Line> {
    match device {
        DeviceKind::Cpu => vec![Line::ok("device: cpu — no GPU libraries needed")],
        DeviceKind::Gpu => {
            let mut lines = vec![if cfg!(feature = "cuda") {
                Line::ok("device: gpu — built with CUDA support")
            } else {
                Line::fail(
                    "device: gpu — built without CUDA support; rebuild with --features cuda, or set \
                     cluster.device = \"cpu\"",
                )
            }];
            lines.extend(check_driver());
            lines.push(check_library(LIBNCCL, "install NCCL"));
            lines
        }
    }
}

/// The driver loads, counts at least one device, and runs the CUDA the toolchain builds with.
fn check_driver() -> Vec<Line> {
    let (line, library) = count_devices();
    let mut lines = vec![line];
    if let Some(library) = library {
        lines.extend(driver_version(&library));
    }
    lines
}

/// The newest CUDA the driver runs, against the toolchain's.
fn driver_version(library: &Library) -> Option<Line> {
    let version = library.symbol(c"cuDriverGetVersion")?;
    // SAFETY: cuDriverGetVersion's C ABI signature; it writes one int we own, and needs no cuInit.
    let version = unsafe { std::mem::transmute::<*mut c_void, CuDriverGetVersion>(version) };
    let mut cuda: c_int = 0;
    // SAFETY: as above.
    if unsafe { version(&mut cuda) } != 0 {
        return None;
    }
    Some(version_line(cuda))
}

fn version_line(cuda: c_int) -> Line {
    let shown = format!("{}.{}", cuda / 1000, cuda % 1000 / 10);
    if cuda >= TOOLCHAIN_CUDA {
        Line::ok(format!("device: the driver runs CUDA up to {shown}"))
    } else {
        Line::warn(format!(
            "device: the driver runs CUDA up to {shown}, older than the {}.{} scripts/cuda-toolchain.sh builds \
             with — update the driver (580 or later), or build with this machine's own CUDA toolkit",
            TOOLCHAIN_CUDA / 1000,
            TOOLCHAIN_CUDA % 1000 / 10
        ))
    }
}

/// The driver loads and counts at least one device; the library, when it loads.
fn count_devices() -> (Line, Option<Library>) {
    let name = LIBCUDA.to_string_lossy();
    let library = match Library::open(LIBCUDA) {
        Ok(library) => library,
        Err(why) => return (cannot_load(&name, &why, "install the NVIDIA driver"), None),
    };
    let (Some(init), Some(count)) = (library.symbol(c"cuInit"), library.symbol(c"cuDeviceGetCount")) else {
        let line = Line::fail(format!(
            "device: {name} loads but lacks cuInit or cuDeviceGetCount — reinstall the NVIDIA driver"
        ));
        return (line, None);
    };
    // SAFETY: the symbols come from the CUDA driver, whose C ABI declares these signatures.
    let (init, count) = unsafe {
        (
            std::mem::transmute::<*mut c_void, CuInit>(init),
            std::mem::transmute::<*mut c_void, CuDeviceGetCount>(count),
        )
    };
    let mut devices: c_int = 0;
    // SAFETY: cuInit takes flags (must be 0); cuDeviceGetCount writes one int we own. The library
    // stays loaded (`RTLD_NODELETE`) while the driver's threads may run.
    let result = unsafe {
        match init(0) {
            0 => count(&mut devices),
            error => error,
        }
    };
    let line = match result {
        0 if devices > 0 => Line::ok(format!("device: {name} loads; {devices} CUDA device(s)")),
        0 | CUDA_ERROR_NO_DEVICE => Line::fail(format!(
            "device: {name} loads but sees no CUDA device — check nvidia-smi and CUDA_VISIBLE_DEVICES"
        )),
        CUDA_ERROR_STUB_LIBRARY => Line::fail(format!(
            "device: the {name} found is a link-time stub, not the NVIDIA driver — take its folder off \
             LD_LIBRARY_PATH, or install the driver"
        )),
        error => Line::fail(format!(
            "device: {name} loads but the driver fails (CUresult {error}) — check nvidia-smi; the driver may be \
             older than its library, or the device in use or lost"
        )),
    };
    (line, Some(library))
}

/// `name` can be loaded.
fn check_library(name: &CStr, install: &str) -> Line {
    let shown = name.to_string_lossy();
    match Library::open(name) {
        Ok(_) => Line::ok(format!("device: {shown} loads")),
        Err(why) => cannot_load(&shown, &why, install),
    }
}

fn cannot_load(name: &str, why: &str, install: &str) -> Line {
    Line::fail(format!(
        "device: {name} cannot be loaded ({why}) — {install}, or add its directory to LD_LIBRARY_PATH"
    ))
}

/// A shared library loaded with `dlopen`, closed on drop.
struct Library {
    handle: *mut c_void,
}

impl Library {
    /// Loads `name` lazily. `RTLD_NODELETE` keeps it mapped after the close: the CUDA driver
    /// starts threads in `cuInit` that run its code.
    fn open(name: &CStr) -> Result<Self, String> {
        // SAFETY: `name` is a NUL-terminated string; dlopen runs the library's initialisers,
        // which the system libraries named here are built to have run.
        let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NODELETE) };
        if handle.is_null() {
            return Err(dl_error());
        }
        Ok(Self { handle })
    }

    /// The address of `symbol`, if the library has it.
    fn symbol(&self, symbol: &CStr) -> Option<*mut c_void> {
        // SAFETY: `handle` is a live handle from dlopen and `symbol` is NUL-terminated.
        let address = unsafe { libc::dlsym(self.handle, symbol.as_ptr()) };
        (!address.is_null()).then_some(address)
    }
}

impl Drop for Library {
    fn drop(&mut self) {
        // SAFETY: `handle` came from a successful dlopen and is closed exactly once.
        unsafe {
            libc::dlclose(self.handle);
        }
    }
}

/// The message of the last failed `dl*` call on this thread.
fn dl_error() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated string valid until the next dl* call on
    // this thread; it is copied at once.
    unsafe {
        let message = libc::dlerror();
        if message.is_null() {
            "unknown error".to_string()
        } else {
            CStr::from_ptr(message).to_string_lossy().into_owned()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::report::Status;

    #[test]
    fn cpu_needs_nothing() {
        assert_eq!(
            check_device(DeviceKind::Cpu),
            [Line::ok("device: cpu — no GPU libraries needed")]
        );
    }

    #[test]
    #[cfg(not(feature = "cuda"))]
    fn gpu_fails_in_a_build_without_cuda_and_names_each_library() {
        let lines = check_device(DeviceKind::Gpu);
        assert_eq!(lines.len(), 3);
        assert_eq!(lines[0].status, Status::Fail);
        assert!(lines[0].text.contains("built without CUDA support"), "{}", lines[0]);
        assert!(lines[1].text.starts_with("device: libcuda.so.1 "), "{}", lines[1]);
        assert!(lines[2].text.starts_with("device: libnccl.so.2 "), "{}", lines[2]);
    }

    #[test]
    fn a_driver_older_than_the_toolchain_is_a_warning() {
        assert_eq!(version_line(13020), Line::ok("device: the driver runs CUDA up to 13.2"));
        let old = version_line(12040);
        assert_eq!(old.status, Status::Warn);
        assert!(
            old.text
                .starts_with("device: the driver runs CUDA up to 12.4, older than the 13.0"),
            "{old}"
        );
    }

    #[test]
    fn libraries_that_load_and_that_do_not() {
        assert_eq!(check_library(c"libc.so.6", "x"), Line::ok("device: libc.so.6 loads"));
        let line = check_library(c"libflotilla-no-such-library.so.9", "install it");
        assert_eq!(line.status, Status::Fail);
        assert!(
            line.text
                .starts_with("device: libflotilla-no-such-library.so.9 cannot be loaded (")
                && line
                    .text
                    .ends_with("— install it, or add its directory to LD_LIBRARY_PATH"),
            "{line}"
        );
    }

    #[test]
    fn libraries_lack_symbols_they_do_not_define() {
        let library = Library::open(c"libc.so.6").unwrap();
        assert!(library.symbol(c"malloc").is_some());
        assert!(library.symbol(c"cuInit").is_none());
    }
}

//! `CUresult` codes, the driver's typed error, and the panic guard every export goes through.

pub type CUresult = i32;

pub const CUDA_SUCCESS: CUresult = 0;

/// The errors the simulated driver returns, each with its `CUresult` value from `cuda.h`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum CudaError {
    #[error("invalid argument")]
    InvalidValue,
    #[error("out of memory")]
    OutOfMemory,
    #[error("initialization error")]
    NotInitialized,
    #[error("no CUDA-capable device is detected")]
    NoDevice,
    #[error("invalid device ordinal")]
    InvalidDevice,
    #[error("invalid device context")]
    InvalidContext,
    #[error("context is destroyed")]
    ContextIsDestroyed,
    #[error("invalid resource handle")]
    InvalidHandle,
    #[error("named symbol not found")]
    NotFound,
    #[error("device not ready")]
    NotReady,
    #[error("operation not supported")]
    NotSupported,
    #[error("operation not permitted when stream is capturing")]
    StreamCaptureUnsupported,
    #[error("operation failed due to a previous error during capture")]
    StreamCaptureInvalidated,
    #[error("operation not permitted on an event last recorded in a capturing stream")]
    IllegalState,
    #[error("device kernel image is invalid")]
    InvalidImage,
    #[error("a PTX JIT compilation failed")]
    InvalidPtx,
    #[error("the provided PTX was compiled with an unsupported toolchain")]
    UnsupportedPtxVersion,
    #[error("operation not permitted")]
    NotPermitted,
    #[error("operation would make the legacy stream depend on a capturing blocking stream")]
    StreamCaptureImplicit,
    #[error("attempt to terminate a thread-local capture sequence from another thread")]
    StreamCaptureWrongThread,
    #[error("the capture was not initiated in this stream")]
    StreamCaptureUnmatched,
    #[error("operation would have resulted in a merge of two independent capture sequences")]
    StreamCaptureMerge,
    #[error("the capture sequence contains a fork that was not joined to the primary stream")]
    StreamCaptureUnjoined,
    #[error("unknown error")]
    Unknown,
}

impl CudaError {
    pub fn code(self) -> CUresult {
        match self {
            CudaError::InvalidValue => 1,
            CudaError::OutOfMemory => 2,
            CudaError::NotInitialized => 3,
            CudaError::NoDevice => 100,
            CudaError::InvalidDevice => 101,
            CudaError::InvalidContext => 201,
            CudaError::ContextIsDestroyed => 709,
            CudaError::InvalidHandle => 400,
            CudaError::IllegalState => 401,
            CudaError::NotFound => 500,
            CudaError::NotReady => 600,
            CudaError::NotSupported => 801,
            CudaError::StreamCaptureUnsupported => 900,
            CudaError::StreamCaptureInvalidated => 901,
            CudaError::InvalidImage => 200,
            CudaError::InvalidPtx => 218,
            CudaError::UnsupportedPtxVersion => 222,
            CudaError::NotPermitted => 800,
            CudaError::StreamCaptureImplicit => 906,
            CudaError::StreamCaptureWrongThread => 908,
            CudaError::StreamCaptureUnmatched => 903,
            CudaError::StreamCaptureMerge => 902,
            CudaError::StreamCaptureUnjoined => 904,
            CudaError::Unknown => 999,
        }
    }

    pub const ALL: [CudaError; 24] = [
        CudaError::InvalidValue,
        CudaError::OutOfMemory,
        CudaError::NotInitialized,
        CudaError::NoDevice,
        CudaError::InvalidDevice,
        CudaError::InvalidContext,
        CudaError::ContextIsDestroyed,
        CudaError::InvalidHandle,
        CudaError::IllegalState,
        CudaError::NotFound,
        CudaError::NotReady,
        CudaError::NotSupported,
        CudaError::StreamCaptureUnsupported,
        CudaError::StreamCaptureInvalidated,
        CudaError::InvalidImage,
        CudaError::InvalidPtx,
        CudaError::UnsupportedPtxVersion,
        CudaError::NotPermitted,
        CudaError::StreamCaptureImplicit,
        CudaError::StreamCaptureWrongThread,
        CudaError::StreamCaptureUnmatched,
        CudaError::StreamCaptureMerge,
        CudaError::StreamCaptureUnjoined,
        CudaError::Unknown,
    ];

    pub fn from_code(code: CUresult) -> Option<CudaError> {
        Self::ALL.into_iter().find(|e| e.code() == code)
    }

    /// `cuGetErrorName`'s answer, NUL-terminated.
    pub fn name(self) -> &'static [u8] {
        match self {
            CudaError::InvalidValue => b"CUDA_ERROR_INVALID_VALUE\0",
            CudaError::OutOfMemory => b"CUDA_ERROR_OUT_OF_MEMORY\0",
            CudaError::NotInitialized => b"CUDA_ERROR_NOT_INITIALIZED\0",
            CudaError::NoDevice => b"CUDA_ERROR_NO_DEVICE\0",
            CudaError::InvalidDevice => b"CUDA_ERROR_INVALID_DEVICE\0",
            CudaError::InvalidContext => b"CUDA_ERROR_INVALID_CONTEXT\0",
            CudaError::ContextIsDestroyed => b"CUDA_ERROR_CONTEXT_IS_DESTROYED\0",
            CudaError::InvalidHandle => b"CUDA_ERROR_INVALID_HANDLE\0",
            CudaError::IllegalState => b"CUDA_ERROR_ILLEGAL_STATE\0",
            CudaError::NotFound => b"CUDA_ERROR_NOT_FOUND\0",
            CudaError::NotReady => b"CUDA_ERROR_NOT_READY\0",
            CudaError::NotSupported => b"CUDA_ERROR_NOT_SUPPORTED\0",
            CudaError::StreamCaptureUnsupported => b"CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED\0",
            CudaError::StreamCaptureInvalidated => b"CUDA_ERROR_STREAM_CAPTURE_INVALIDATED\0",
            CudaError::InvalidImage => b"CUDA_ERROR_INVALID_IMAGE\0",
            CudaError::InvalidPtx => b"CUDA_ERROR_INVALID_PTX\0",
            CudaError::UnsupportedPtxVersion => b"CUDA_ERROR_UNSUPPORTED_PTX_VERSION\0",
            CudaError::NotPermitted => b"CUDA_ERROR_NOT_PERMITTED\0",
            CudaError::StreamCaptureImplicit => b"CUDA_ERROR_STREAM_CAPTURE_IMPLICIT\0",
            CudaError::StreamCaptureWrongThread => b"CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD\0",
            CudaError::StreamCaptureUnmatched => b"CUDA_ERROR_STREAM_CAPTURE_UNMATCHED\0",
            CudaError::StreamCaptureMerge => b"CUDA_ERROR_STREAM_CAPTURE_MERGE\0",
            CudaError::StreamCaptureUnjoined => b"CUDA_ERROR_STREAM_CAPTURE_UNJOINED\0",
            CudaError::Unknown => b"CUDA_ERROR_UNKNOWN\0",
        }
    }

    /// `cuGetErrorString`'s answer, NUL-terminated.
    pub fn description(self) -> &'static [u8] {
        match self {
            CudaError::InvalidValue => b"invalid argument\0",
            CudaError::OutOfMemory => b"out of memory\0",
            CudaError::NotInitialized => b"initialization error\0",
            CudaError::NoDevice => b"no CUDA-capable device is detected\0",
            CudaError::InvalidDevice => b"invalid device ordinal\0",
            CudaError::InvalidContext => b"invalid device context\0",
            CudaError::ContextIsDestroyed => b"context is destroyed\0",
            CudaError::InvalidHandle => b"invalid resource handle\0",
            CudaError::IllegalState => b"the operation cannot be performed in the present state\0",
            CudaError::NotFound => b"named symbol not found\0",
            CudaError::NotReady => b"device not ready\0",
            CudaError::NotSupported => b"operation not supported\0",
            CudaError::StreamCaptureUnsupported => {
                b"operation not permitted when stream is capturing\0"
            }
            CudaError::StreamCaptureInvalidated => {
                b"operation failed due to a previous error during capture\0"
            }
            CudaError::InvalidImage => b"device kernel image is invalid\0",
            CudaError::InvalidPtx => b"a PTX JIT compilation failed\0",
            CudaError::UnsupportedPtxVersion => {
                b"the provided PTX was compiled with an unsupported toolchain\0"
            }
            CudaError::NotPermitted => b"operation not permitted\0",
            CudaError::StreamCaptureImplicit => {
                b"operation would make the legacy stream depend on a capturing blocking stream\0"
            }
            CudaError::StreamCaptureWrongThread => {
                b"attempt to terminate a thread-local capture sequence from another thread\0"
            }
            CudaError::StreamCaptureUnmatched => b"the capture was not initiated in this stream\0",
            CudaError::StreamCaptureMerge => {
                b"operation would have resulted in a merge of two independent capture sequences\0"
            }
            CudaError::StreamCaptureUnjoined => {
                b"the capture sequence contains a fork that was not joined to the primary stream\0"
            }
            CudaError::Unknown => b"unknown error\0",
        }
    }
}

impl From<simgpu_model::DeviceError> for CudaError {
    fn from(e: simgpu_model::DeviceError) -> CudaError {
        use simgpu_model::DeviceError as D;
        match e {
            D::OutOfMemory { .. } => CudaError::OutOfMemory,
            D::InvalidGpu(_) => CudaError::InvalidDevice,
            D::StaleContext => CudaError::ContextIsDestroyed,
            D::InvalidEvent => CudaError::InvalidHandle,
            D::NoFreeSlot(_) => CudaError::OutOfMemory,
            _ => CudaError::Unknown,
        }
    }
}

pub type CuResult<T> = Result<T, CudaError>;

/// Runs an export's body, turning its error into a `CUresult` and a panic into
/// `CUDA_ERROR_UNKNOWN`: unwinding into C is undefined behaviour (and aborts since Rust 1.81).
/// It is also the export's run as a checkpoint lock sees it ([`crate::driver::ApiCall`]).
pub fn guard(body: impl FnOnce() -> CuResult<()>) -> CUresult {
    let _call = crate::driver::ApiCall::enter();
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) {
        Ok(Ok(())) => CUDA_SUCCESS,
        Ok(Err(e)) => e.code(),
        Err(_) => CudaError::Unknown.code(),
    }
}

/// Writes an out-parameter, rejecting NULL as the real driver does.
///
/// # Safety
/// `ptr` must be NULL or valid for a write of `T` (the caller's side of the CUDA API contract).
pub unsafe fn write_out<T>(ptr: *mut T, value: T) -> CuResult<()> {
    if ptr.is_null() {
        return Err(CudaError::InvalidValue);
    }
    // SAFETY: non-null and valid per this function's contract.
    unsafe { ptr.write(value) };
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_unique_and_round_trip() {
        for e in CudaError::ALL {
            assert_eq!(CudaError::from_code(e.code()), Some(e));
            assert_eq!(*e.name().last().unwrap(), 0);
            assert_eq!(*e.description().last().unwrap(), 0);
        }
        assert_eq!(CudaError::OutOfMemory.code(), 2);
        assert_eq!(CudaError::from_code(12345), None);
    }

    #[test]
    fn guard_turns_panics_into_unknown() {
        assert_eq!(guard(|| Ok(())), 0);
        assert_eq!(guard(|| Err(CudaError::NotReady)), 600);
        assert_eq!(guard(|| panic!("boom")), 999);
    }
}

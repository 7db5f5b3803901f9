//! mdkit-io: the member I/O layer. One block-device abstraction ([`BlockDevice`]) with owned,
//! aligned buffers ([`IoBuf`], [`SharedBuf`]); backends (io_uring files and block devices, a
//! sparse RAM disk) and decorators (fault injection, crash recording, flash latency model,
//! tracing) that stack over any backend.

pub mod buf;
pub mod crash;
pub mod device;
pub mod fault;
pub mod file;
pub mod flash;
pub mod mem;
pub mod rng;
pub mod timer;
pub mod trace;

pub use buf::{BUF_ALIGN, IoBuf, SharedBuf};
pub use crash::{
    CrashDevice, CrashEvent, CrashEventKind, CrashGroup, CrashOptions, CrashPoint, CrashPolicy, DiscardModel,
};
pub use device::{
    BlockDevice, BlockDeviceExt, DeviceRef, IoFuture, IoOp, PerOp, ReadResult, Topology, WriteFlags, ZeroFlags,
    check_io, unsupported,
};
pub use fault::{FaultAction, FaultHandle, FaultRule, FaultStats, FaultyDevice, InjectedFault, OpMask, RuleId, injected_errno};
pub use file::{DirectMode, FileDevice, FileOptions};
pub use flash::{FlashDevice, FlashHandle, FlashModel, FlashStats};
pub use mem::MemDevice;
pub use rng::Rng;
pub use timer::MicroTimer;
pub use trace::{DeviceTraceStats, OpTraceStats, TraceEvent, TraceSnapshot, TracedDevice, Tracer};

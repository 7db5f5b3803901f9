//! mdkit-io: the member I/O layer. One block-device abstraction ([`BlockDevice`]) with owned,
//! aligned buffers ([`IoBuf`], [`SharedBuf`]); backends (io_uring files and block devices, a
//! sparse RAM disk) and decorators (fault injection, crash recording, flash latency model,
//! tracing) that stack over any backend.
//!
//! | module    | what                                                                     |
//! |-----------|--------------------------------------------------------------------------|
//! | [`device`] | the [`BlockDevice`] contract, [`check_io`], [`IoOp`], [`PerOp`]          |
//! | [`buf`]    | [`IoBuf`] / [`SharedBuf`]: owned 4 KiB-aligned buffers                  |
//! | [`extent`] | [`Extent`] / [`ExtentList`]: block status (holes, zeroes) of a range     |
//! | [`file`](mod@file) | [`FileDevice`]: files and block devices through io_uring + O_DIRECT     |
//! | [`mem`]    | [`MemDevice`]: sparse RAM disk, base of the simulated disks             |
//! | [`nbd_client`] | [`NbdDevice`]: a member on a remote NBD server (`nbd://`, `nbd+unix://`) |
//! | [`nbd_wire`] | NBD protocol constants, shared with the server in mdkit-nbd              |
//! | [`flush`]  | [`FlushBatcher`]: one flush round serves every request that came before it |
//! | [`plug`]   | [`Plug`] / [`plugged`]: batch io_uring submissions of one poll          |
//! | [`error`]  | [`DeviceError`] / [`IoErrorKind`]: typed errors of every device         |
//! | [`fault`]  | [`FaultyDevice`]: I/O errors, pulled disks, dropped writes              |
//! | [`lock`]   | [`DeviceLock`]: one writer per device across processes (`flock`)       |
//! | [`crash`]  | [`CrashGroup`] / [`CrashDevice`]: power cuts at any point, many members |
//! | [`flash`]  | [`FlashDevice`]: 4 KiB write unit, read-modify-write latency            |
//! | [`trace`]  | [`Tracer`] / [`TracedDevice`]: events, counters, histograms             |
//! | [`writeback`] | [`WriteBackDevice`]: bounded write-back, plain writes answered once queued |
//! | [`timer`]  | [`MicroTimer`]: microsecond sleeps on tokio (timerfd)                   |
//! | [`rng`]    | [`Rng`]: the deterministic PRNG of every simulation                     |
//!
//! Decorators are generic over `D: BlockDevice` (including `Arc<dyn BlockDevice>`) and each
//! hands out a cheap clonable handle to control or inspect it while I/O runs.

pub mod buf;
pub mod crash;
pub mod device;
pub mod error;
pub mod extent;
pub mod fault;
pub mod file;
pub mod flash;
pub mod flush;
pub mod lock;
pub mod loopdev;
pub mod mem;
pub mod nbd_client;
pub mod nbd_wire;
pub mod plug;
pub mod rng;
pub mod timer;
pub mod trace;
pub mod writeback;

pub use buf::{BUF_ALIGN, IoBuf, SharedBuf};
pub use crash::{
    CrashDevice, CrashEvent, CrashEventKind, CrashGroup, CrashOptions, CrashPoint, CrashPolicy, DiscardModel,
};
pub use device::{
    BlockDevice, BlockDeviceExt, DeviceRef, IoFuture, IoOp, PerOp, ReadResult, Topology, WriteFlags, ZeroFlags,
    check_io, join_read_parts, unsupported,
};
pub use error::{DeviceError, IoErrorKind};
pub use extent::{Extent, ExtentFlags, ExtentList, check_status_range, seek_extents};
pub use fault::{
    FaultAction, FaultHandle, FaultRule, FaultStats, FaultyDevice, OpMask, PER_MILLION_ALWAYS, RuleId, injected_errno,
};
pub use file::{
    DirectMode, FileDevice, FileOptions, INLINE_COPY_MAX_BYTES, SubmitStats, enable_thread_rings, poll_thread_rings,
};
pub use flash::{FlashDevice, FlashHandle, FlashModel, FlashStats};
pub use flush::{FlushBatcher, FlushStats};
pub use lock::{DeviceLock, LockMode};
pub use mem::MemDevice;
pub use nbd_client::{LinkStatus, NbdClientError, NbdClientOptions, NbdDevice, NbdErrorKind, NbdUri, is_nbd_uri};
pub use plug::{Plug, Plugged, is_plugged, plugged};
pub use rng::Rng;
pub use timer::MicroTimer;
pub use trace::{DeviceTraceStats, OpTraceStats, TraceEvent, TraceSnapshot, TracedDevice, Tracer};
pub use writeback::{WriteBackDevice, WriteBackHandle, WriteBackOptions, WriteBackStats};

//! mdkit-io: the member I/O layer. One block-device abstraction ([`BlockDevice`]) with owned,
//! aligned buffers ([`IoBuf`], [`SharedBuf`]); backends (io_uring files and block devices, a
//! sparse RAM disk) and decorators (fault injection, crash recording, flash latency model,
//! tracing) that stack over any backend.

pub mod buf;
pub mod device;
pub mod file;
pub mod mem;
pub mod rng;

pub use buf::{BUF_ALIGN, IoBuf, SharedBuf};
pub use device::{
    BlockDevice, BlockDeviceExt, DeviceRef, IoFuture, IoOp, ReadResult, Topology, WriteFlags, ZeroFlags, check_io,
    unsupported,
};
pub use file::{DirectMode, FileDevice, FileOptions};
pub use mem::MemDevice;
pub use rng::Rng;

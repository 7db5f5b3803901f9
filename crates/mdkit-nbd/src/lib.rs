//! mdkit-nbd: an NBD server (fixed newstyle handshake, structured replies) that serves any
//! [`mdkit_io::BlockDevice`] — a member file, an md array, a thin volume.
//!
//! ```text
//!   NbdServer ── listen(tcp | unix) ── accept ── handshake (options) ── transmission
//!      │                                                  │
//!      └── exports: name → ExportState { Export { device: DeviceRef, .. }, stats, gate }
//! ```
//!
//! Protocol coverage: options GO, INFO (EXPORT, NAME, DESCRIPTION, BLOCK_SIZE), EXPORT_NAME,
//! LIST, ABORT, STRUCTURED_REPLY, LIST_META_CONTEXT, SET_META_CONTEXT (other options:
//! `NBD_REP_ERR_UNSUP`); commands READ, WRITE (FUA), FLUSH, TRIM, WRITE_ZEROES (NO_HOLE,
//! FAST_ZERO), BLOCK_STATUS (REQ_ONE; contexts in [`meta_context`]), DISC. Requests that are
//! not aligned to the device block are served by read-modify-write when the client did not
//! promise alignment (see [`gate`]). The crate README lists the reply each malformed request
//! gets.
//!
//! ```no_run
//! # async fn demo() -> std::io::Result<()> {
//! use std::sync::Arc;
//! use mdkit_nbd::{Export, ListenAddr, NbdServer, ServerOptions};
//! let server = NbdServer::new(ServerOptions::default());
//! let device = Arc::new(mdkit_io::MemDevice::new("ram0", 1 << 30));
//! server.add_export(Export { name: "ram0".into(), description: String::new(), device, read_only: false })?;
//! server.listen(&"127.0.0.1:10809".parse::<ListenAddr>().unwrap()).await?;
//! # Ok(()) }
//! ```

pub mod admission;
mod block_status;
pub mod budget;
mod conn;
pub mod export;
pub mod failure_log;
#[doc(hidden)]
pub mod fuzzing;
pub mod gate;
pub mod handshake;
pub mod latency;
pub mod meta_context;
pub mod proto;
mod reader;
pub mod server;
mod stall;
mod taskset;
pub mod threads;

pub use admission::AdmissionSnapshot;
pub use budget::BudgetSnapshot;
pub use export::{BlockSizes, Export, ExportStats, ExportStatsSnapshot};
pub use latency::{LATENCY_BUCKET_BOUNDS_US, LatencySnapshot, RequestClass};
pub use server::{ListenAddr, NbdServer, ServerOptions, ShutdownReport};
pub use threads::{ConnectionThreads, idle_poll};

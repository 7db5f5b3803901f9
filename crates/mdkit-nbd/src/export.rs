//! What the server serves: named exports over shared block devices, and their counters.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use mdkit_io::{DeviceRef, Topology};

use crate::gate::WriteGate;
use crate::latency::{ExportLatency, LatencySnapshot, RequestClass};
use crate::proto::*;

/// One export as configured by the service.
#[derive(Clone)]
pub struct Export {
    /// Name clients ask for (`nbd://host/NAME`).
    pub name: String,
    /// Free text shown by `NBD_OPT_LIST` / `NBD_INFO_DESCRIPTION`.
    pub description: String,
    pub device: DeviceRef,
    pub read_only: bool,
}

/// Per-export counters; cheap relaxed atomics updated on the data path.
#[derive(Default, Debug)]
pub struct ExportStats {
    pub reads: AtomicU64,
    pub writes: AtomicU64,
    pub flushes: AtomicU64,
    pub trims: AtomicU64,
    pub write_zeroes: AtomicU64,
    /// BLOCK_STATUS requests answered.
    pub block_status: AtomicU64,
    pub read_bytes: AtomicU64,
    pub written_bytes: AtomicU64,
    /// Requests answered with an error (validation or device).
    pub errors: AtomicU64,
    /// Requests dispatched and not yet answered.
    pub in_flight: AtomicU64,
    /// Connections currently in transmission on this export.
    pub connections: AtomicU64,
    /// Read-modify-write cycles done for requests smaller than / misaligned to a block.
    pub rmw_cycles: AtomicU64,
    /// Request service time per request class (cache-line aligned, after the counters).
    pub latency: ExportLatency,
}

/// A point-in-time copy of [`ExportStats`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExportStatsSnapshot {
    pub reads: u64,
    pub writes: u64,
    pub flushes: u64,
    pub trims: u64,
    pub write_zeroes: u64,
    pub block_status: u64,
    pub read_bytes: u64,
    pub written_bytes: u64,
    pub errors: u64,
    pub in_flight: u64,
    pub connections: u64,
    pub rmw_cycles: u64,
    /// Per request class, in [`RequestClass::ALL`] order.
    pub latency: Vec<(RequestClass, LatencySnapshot)>,
}

impl ExportStats {
    pub fn snapshot(&self) -> ExportStatsSnapshot {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ExportStatsSnapshot {
            reads: l(&self.reads),
            writes: l(&self.writes),
            flushes: l(&self.flushes),
            trims: l(&self.trims),
            write_zeroes: l(&self.write_zeroes),
            block_status: l(&self.block_status),
            read_bytes: l(&self.read_bytes),
            written_bytes: l(&self.written_bytes),
            errors: l(&self.errors),
            in_flight: l(&self.in_flight),
            connections: l(&self.connections),
            rmw_cycles: l(&self.rmw_cycles),
            latency: self.latency.snapshot(),
        }
    }
}

/// Block-size constraints advertised with `NBD_INFO_BLOCK_SIZE`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockSizes {
    pub min_bytes: u32,
    pub preferred_bytes: u32,
    pub max_payload_bytes: u32,
}

/// An export plus its run-time state, shared by every connection that uses it.
pub struct ExportState {
    pub export: Export,
    pub stats: Arc<ExportStats>,
    /// Orders RMW cycles against other writes. One per export, not per connection, because
    /// the device is shared by all connections.
    pub gate: WriteGate,
    /// Warnings for requests the device failed (rate-limited).
    pub failures: crate::failure_log::FailureLog,
}

impl ExportState {
    pub fn new(export: Export) -> ExportState {
        ExportState {
            export,
            stats: Arc::new(ExportStats::default()),
            gate: WriteGate::new(),
            failures: Default::default(),
        }
    }

    pub fn topology(&self) -> Topology {
        self.export.device.topology()
    }

    /// The device's logical block: the unit of every device request.
    pub fn device_block_bytes(&self) -> u64 {
        u64::from(self.topology().logical_block_bytes.max(1))
    }

    pub fn block_sizes(&self, max_payload_bytes: u32) -> BlockSizes {
        let topo = self.topology();
        let min_bytes = topo.logical_block_bytes.max(512).next_power_of_two().min(64 << 10);
        let preferred_bytes = 4096u32.max(min_bytes);
        BlockSizes { min_bytes, preferred_bytes, max_payload_bytes: max_payload_bytes.max(preferred_bytes) }
    }

    /// Transmission flags for a connection; `structured` says whether structured replies were
    /// negotiated (SEND_DF is only allowed then).
    pub fn transmission_flags(&self, structured: bool) -> u16 {
        let topo = self.topology();
        let mut f = FLAG_HAS_FLAGS | FLAG_SEND_FLUSH;
        if self.export.read_only {
            f |= FLAG_READ_ONLY;
        } else {
            f |= FLAG_SEND_FUA | FLAG_SEND_WRITE_ZEROES | FLAG_SEND_FAST_ZERO;
            if topo.supports_discard {
                f |= FLAG_SEND_TRIM;
            }
        }
        if topo.rotational {
            f |= FLAG_ROTATIONAL;
        }
        if structured {
            // Reads are always answered with a single OFFSET_DATA chunk, so DF costs nothing.
            f |= FLAG_SEND_DF;
        }
        // CAN_MULTI_CONN is true by construction: every connection to this export calls the
        // one shared device object (there is no per-connection cache or queue between the
        // socket and the device), and the BlockDevice contract makes `flush` cover every write
        // that completed before the flush was issued, whoever issued it. A write is replied to
        // only after it completed on the device, so a FLUSH (or FUA) answered on any connection
        // covers every write any connection had been answered for. RMW cycles go through the
        // export-wide write gate, also shared. The kernel client needs this flag to use more
        // than one connection.
        f |= FLAG_CAN_MULTI_CONN;
        f
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mdkit_io::MemDevice;

    #[test]
    fn flags_follow_read_only_and_structured() {
        let dev: DeviceRef = Arc::new(MemDevice::new("m", 1 << 20));
        let rw = ExportState::new(Export {
            name: "a".into(),
            description: String::new(),
            device: dev.clone(),
            read_only: false,
        });
        let f = rw.transmission_flags(false);
        for bit in [
            FLAG_HAS_FLAGS,
            FLAG_SEND_FLUSH,
            FLAG_SEND_FUA,
            FLAG_SEND_TRIM,
            FLAG_SEND_WRITE_ZEROES,
            FLAG_CAN_MULTI_CONN,
        ] {
            assert_ne!(f & bit, 0, "bit {bit:#x}");
        }
        assert_eq!(f & (FLAG_READ_ONLY | FLAG_SEND_DF), 0);
        assert_ne!(rw.transmission_flags(true) & FLAG_SEND_DF, 0);
        let ro =
            ExportState::new(Export { name: "b".into(), description: String::new(), device: dev, read_only: true });
        let f = ro.transmission_flags(true);
        assert_ne!(f & FLAG_READ_ONLY, 0);
        assert_eq!(f & (FLAG_SEND_TRIM | FLAG_SEND_WRITE_ZEROES | FLAG_SEND_FUA), 0);
        let bs = ro.block_sizes(32 << 20);
        assert_eq!((bs.min_bytes, bs.preferred_bytes, bs.max_payload_bytes), (512, 4096, 32 << 20));
    }
}

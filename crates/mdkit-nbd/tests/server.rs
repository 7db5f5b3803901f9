//! In-process server over RAM disks with unusual topologies (4 KiB logical blocks, a small
//! maximum I/O, no native zeroing, no discard), driven by a hand-written blocking client.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use mdkit_io::{BlockDevice, BlockDeviceExt, MemDevice, Topology};
use mdkit_nbd::{Export, ListenAddr, NbdServer, ServerOptions};

struct Fixture {
    rt: tokio::runtime::Runtime,
    server: NbdServer,
    addr: String,
}

fn serve(dev: Arc<MemDevice>) -> Fixture {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let server = NbdServer::new(ServerOptions { max_in_flight_requests: 8, ..ServerOptions::default() });
    server.add_export(Export { name: "d".into(), description: String::new(), device: dev, read_only: false }).unwrap();
    let addr = rt.block_on(server.listen(&"127.0.0.1:0".parse::<ListenAddr>().unwrap())).unwrap();
    let ListenAddr::Tcp(addr) = addr else { unreachable!() };
    Fixture { rt, server, addr }
}

struct Client(TcpStream);

impl Client {
    fn open(addr: &str) -> Client {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut hello = [0u8; 18];
        s.read_exact(&mut hello).unwrap();
        s.write_all(&3u32.to_be_bytes()).unwrap();
        // NBD_OPT_GO "d", no info requests (so unaligned requests are allowed).
        let mut opt = 0x4948_4156_454f_5054u64.to_be_bytes().to_vec();
        opt.extend_from_slice(&7u32.to_be_bytes());
        opt.extend_from_slice(&7u32.to_be_bytes());
        opt.extend_from_slice(&1u32.to_be_bytes());
        opt.push(b'd');
        opt.extend_from_slice(&0u16.to_be_bytes());
        s.write_all(&opt).unwrap();
        let mut c = Client(s);
        loop {
            let h = c.recv(20);
            let kind = u32::from_be_bytes(h[12..16].try_into().unwrap());
            let len = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
            c.recv(len);
            match kind {
                1 => return c,
                3 => {}
                k => panic!("GO failed: {k:#x}"),
            }
        }
    }
    fn recv(&mut self, n: usize) -> Vec<u8> {
        let mut v = vec![0u8; n];
        self.0.read_exact(&mut v).unwrap();
        v
    }
    fn request(&mut self, kind: u16, flags: u16, offset: u64, len: u32, payload: &[u8]) -> u32 {
        let mut b = 0x2560_9513u32.to_be_bytes().to_vec();
        b.extend_from_slice(&flags.to_be_bytes());
        b.extend_from_slice(&kind.to_be_bytes());
        b.extend_from_slice(&7u64.to_be_bytes());
        b.extend_from_slice(&offset.to_be_bytes());
        b.extend_from_slice(&len.to_be_bytes());
        b.extend_from_slice(payload);
        self.0.write_all(&b).unwrap();
        let r = self.recv(16);
        u32::from_be_bytes(r[4..8].try_into().unwrap())
    }
    fn write(&mut self, offset: u64, data: &[u8]) {
        assert_eq!(self.request(1, 0, offset, data.len() as u32, data), 0, "write {offset}+{}", data.len());
    }
    fn read(&mut self, offset: u64, len: u32) -> Vec<u8> {
        assert_eq!(self.request(0, 0, offset, len, &[]), 0, "read {offset}+{len}");
        self.recv(len as usize)
    }
}

fn bytes(seed: u8, n: usize) -> Vec<u8> {
    (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

#[test]
fn four_kib_device_small_max_io_no_zeroing_no_discard() {
    let mut topo = Topology::simple(8 << 20);
    topo.logical_block_bytes = 4096;
    topo.max_io_bytes = 64 << 10;
    topo.supports_write_zeroes = false;
    topo.supports_discard = false;
    let dev = Arc::new(MemDevice::with_topology("mem4k", topo));
    let f = serve(dev.clone());
    let mut c = Client::open(&f.addr);

    // 1 MiB write and read: split into 64 KiB device requests.
    let big = bytes(1, 1 << 20);
    c.write(0, &big);
    assert!(c.read(0, 1 << 20) == big);
    // Unaligned to the 4 KiB device block (and spanning the 64 KiB split) from an
    // unaligned client: read-modify-write.
    let odd = bytes(2, 70_000);
    c.write(5000, &odd);
    let mut model = big.clone();
    model[5000..75_000].copy_from_slice(&odd);
    assert!(c.read(0, 1 << 20) == model);
    assert_eq!(c.read(4999, 3), model[4999..5002]);
    // Write-zeroes without native support: zero buffers written, partial blocks patched.
    assert_eq!(c.request(6, 0, 100, 300_000, &[]), 0);
    model[100..300_100].fill(0);
    // FAST_ZERO cannot be honoured without native zeroing.
    assert_eq!(c.request(6, 16, 0, 4096, &[]), 95);
    // TRIM on a device without discard: accepted, nothing changes (advisory).
    assert_eq!(c.request(4, 0, 0, 8192, &[]), 0);
    assert!(c.read(0, 1 << 20) == model);
    let on_device: Vec<u8> = (0..16u64).flat_map(|i| f.rt.block_on(dev.read_vec(i * 65536, 65536)).unwrap()).collect();
    assert!(on_device == model, "the device holds what the client read");

    let stats = f.server.export_stats();
    assert!(stats[0].1.rmw_cycles >= 2, "{:?}", stats[0].1);
    let report = f.rt.block_on(f.server.shutdown(Duration::from_secs(5)));
    assert_eq!(report.connections_aborted, 0);
    assert!(report.flush_errors.is_empty());
    assert_eq!(dev.topology().logical_block_bytes, 4096);
}

#[test]
fn many_connections_and_queue_depth_above_the_limit() {
    let dev = Arc::new(MemDevice::new("mem", 16 << 20));
    let f = serve(dev);
    // 8 connections, each pipelining 64 writes (the per-connection limit is 8 in flight),
    // then reading everything back.
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let addr = f.addr.clone();
            std::thread::spawn(move || {
                let mut c = Client::open(&addr);
                let base = t * (2 << 20);
                let mut all = Vec::new();
                for i in 0..64u64 {
                    let d = bytes((t * 64 + i) as u8, 8192);
                    all.extend_from_slice(&{
                        let mut b = 0x2560_9513u32.to_be_bytes().to_vec();
                        b.extend_from_slice(&0u16.to_be_bytes());
                        b.extend_from_slice(&1u16.to_be_bytes());
                        b.extend_from_slice(&i.to_be_bytes());
                        b.extend_from_slice(&(base + i * 8192).to_be_bytes());
                        b.extend_from_slice(&8192u32.to_be_bytes());
                        b.extend_from_slice(&d);
                        b
                    });
                }
                c.0.write_all(&all).unwrap();
                for _ in 0..64 {
                    let r = c.recv(16);
                    assert_eq!(u32::from_be_bytes(r[4..8].try_into().unwrap()), 0);
                }
                for i in 0..64u64 {
                    assert!(c.read(base + i * 8192, 8192) == bytes((t * 64 + i) as u8, 8192));
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let s = &f.server.export_stats()[0].1;
    assert_eq!((s.writes, s.reads, s.errors, s.in_flight), (512, 512, 0, 0));
}

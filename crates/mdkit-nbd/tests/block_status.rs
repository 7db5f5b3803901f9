//! Meta-context negotiation and NBD_CMD_BLOCK_STATUS against an in-process server over a sparse
//! RAM disk (absent pages are holes that read as zeroes): a hand-written client checks the
//! exact option replies, refusals and reply chunks; `nbdinfo --map` reads the same map.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use mdkit_io::{BlockDevice, MemDevice, SharedBuf, WriteFlags};
use mdkit_nbd::meta_context::{META_QUERIES_MAX, encode_meta_request};
use mdkit_nbd::proto::*;
use mdkit_nbd::{Export, ListenAddr, NbdServer, ServerOptions};

const SIZE: u64 = 16 << 20;

struct Fixture {
    _rt: tokio::runtime::Runtime,
    server: NbdServer,
    addr: String,
}

/// Two exports: "d" with 64 KiB of data at 1 MiB and 4 KiB at 8 MiB, "e" empty.
fn serve() -> Fixture {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let server = NbdServer::new(ServerOptions::default());
    let d = Arc::new(MemDevice::new("d", SIZE));
    rt.block_on(d.write(1 << 20, SharedBuf::from_slice(&[1u8; 64 << 10]), WriteFlags::NONE)).unwrap();
    rt.block_on(d.write(8 << 20, SharedBuf::from_slice(&[2u8; 4096]), WriteFlags::NONE)).unwrap();
    for (name, device) in [("d", d), ("e", Arc::new(MemDevice::new("e", SIZE)))] {
        let export = Export { name: name.into(), description: String::new(), device, read_only: true };
        server.add_export(export).unwrap();
    }
    let addr = rt.block_on(server.listen(&"127.0.0.1:0".parse::<ListenAddr>().unwrap())).unwrap();
    let ListenAddr::Tcp(addr) = addr else { unreachable!() };
    Fixture { _rt: rt, server, addr: addr.to_string() }
}

struct Client(TcpStream);

/// One option reply: type and data.
type OptReply = (u32, Vec<u8>);
/// One reply chunk: type, context id (or error number), descriptors (length, flags).
type Chunk = (u16, u32, Vec<(u32, u32)>);

impl Client {
    fn open(addr: &str) -> Client {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut hello = [0u8; 18];
        s.read_exact(&mut hello).unwrap();
        s.write_all(&3u32.to_be_bytes()).unwrap();
        Client(s)
    }

    fn recv(&mut self, n: usize) -> Vec<u8> {
        let mut v = vec![0u8; n];
        self.0.read_exact(&mut v).unwrap();
        v
    }

    fn send_option(&mut self, option: u32, data: &[u8]) {
        let mut b = IHAVEOPT.to_be_bytes().to_vec();
        b.extend_from_slice(&option.to_be_bytes());
        b.extend_from_slice(&(data.len() as u32).to_be_bytes());
        b.extend_from_slice(data);
        self.0.write_all(&b).unwrap();
    }

    /// Sends an option and collects replies up to the final one (ACK or an error).
    fn option(&mut self, option: u32, data: &[u8]) -> Vec<OptReply> {
        self.send_option(option, data);
        let mut out = Vec::new();
        loop {
            let h = self.recv(20);
            assert_eq!(u32::from_be_bytes(h[8..12].try_into().unwrap()), option);
            let kind = u32::from_be_bytes(h[12..16].try_into().unwrap());
            let len = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
            let body = self.recv(len);
            out.push((kind, body));
            if kind == REP_ACK || kind & (1 << 31) != 0 {
                return out;
            }
        }
    }

    fn go(&mut self, name: &str) {
        let mut data = (name.len() as u32).to_be_bytes().to_vec();
        data.extend_from_slice(name.as_bytes());
        data.extend_from_slice(&0u16.to_be_bytes());
        let replies = self.option(OPT_GO, &data);
        assert_eq!(replies.last().unwrap().0, REP_ACK, "GO {name}");
    }

    /// A BLOCK_STATUS request; returns per chunk (type, context id or error, descriptors).
    fn block_status(&mut self, flags: u16, offset: u64, len: u32) -> Vec<Chunk> {
        let mut b = REQUEST_MAGIC.to_be_bytes().to_vec();
        b.extend_from_slice(&flags.to_be_bytes());
        b.extend_from_slice(&CMD_BLOCK_STATUS.to_be_bytes());
        b.extend_from_slice(&9u64.to_be_bytes());
        b.extend_from_slice(&offset.to_be_bytes());
        b.extend_from_slice(&len.to_be_bytes());
        self.0.write_all(&b).unwrap();
        let mut chunks = Vec::new();
        loop {
            let h = self.recv(20);
            assert_eq!(u32::from_be_bytes(h[0..4].try_into().unwrap()), STRUCTURED_REPLY_MAGIC);
            let flags = u16::from_be_bytes([h[4], h[5]]);
            let kind = u16::from_be_bytes([h[6], h[7]]);
            assert_eq!(u64::from_be_bytes(h[8..16].try_into().unwrap()), 9);
            let len = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
            let body = self.recv(len);
            let first = u32::from_be_bytes(body[0..4].try_into().unwrap());
            let descs = if kind == REPLY_TYPE_BLOCK_STATUS {
                assert_eq!((len - 4) % 8, 0);
                body[4..]
                    .chunks_exact(8)
                    .map(|c| {
                        (
                            u32::from_be_bytes(c[0..4].try_into().unwrap()),
                            u32::from_be_bytes(c[4..8].try_into().unwrap()),
                        )
                    })
                    .collect()
            } else {
                Vec::new()
            };
            chunks.push((kind, first, descs));
            if flags & REPLY_FLAG_DONE != 0 {
                return chunks;
            }
        }
    }
}

fn names(replies: &[OptReply]) -> Vec<(u32, String)> {
    replies
        .iter()
        .filter(|r| r.0 == REP_META_CONTEXT)
        .map(|r| (u32::from_be_bytes(r.1[0..4].try_into().unwrap()), String::from_utf8(r.1[4..].to_vec()).unwrap()))
        .collect()
}

#[test]
fn negotiation_follows_the_spec_and_refuses_bad_option_data() {
    let f = serve();
    let mut c = Client::open(&f.addr);
    // LIST works before structured replies (MAY); zero queries list everything.
    let r = c.option(OPT_LIST_META_CONTEXT, &encode_meta_request("d", &[]));
    assert_eq!(names(&r), [(0, "base:allocation".to_string())]);
    assert_eq!(r.last().unwrap().0, REP_ACK);
    // `base:` is a LIST wildcard; an unknown namespace lists nothing; a MemDevice has no
    // changed-since tracking.
    let r = c.option(OPT_LIST_META_CONTEXT, &encode_meta_request("d", &["base:", "x-nope:a", "x-mdkit:"]));
    assert_eq!(names(&r), [(0, "base:allocation".to_string())]);
    // SET needs structured replies first.
    let r = c.option(OPT_SET_META_CONTEXT, &encode_meta_request("d", &["base:allocation"]));
    assert_eq!(r, [(REP_ERR_INVALID, r[0].1.clone())]);
    assert_eq!(c.option(OPT_STRUCTURED_REPLY, &[]).last().unwrap().0, REP_ACK);
    // Malformed data, too many queries, an unknown export.
    let mut bad = encode_meta_request("d", &["base:allocation"]);
    bad.push(0);
    assert_eq!(c.option(OPT_SET_META_CONTEXT, &bad)[0].0, REP_ERR_INVALID);
    let many = vec!["base:allocation"; META_QUERIES_MAX + 1];
    assert_eq!(c.option(OPT_SET_META_CONTEXT, &encode_meta_request("d", &many))[0].0, REP_ERR_TOO_BIG);
    assert_eq!(c.option(OPT_SET_META_CONTEXT, &encode_meta_request("zz", &[]))[0].0, REP_ERR_UNKNOWN);
    // SET: `base:` alone and unknown names are ignored, duplicates collapse, ids from 1.
    let q = ["base:", "x-nope:a", "base:allocation", "base:allocation", "x-mdkit:changed-since:3"];
    let r = c.option(OPT_SET_META_CONTEXT, &encode_meta_request("d", &q));
    assert_eq!(names(&r), [(1, "base:allocation".to_string())]);
    // The selection was for "d"; opening "e" leaves BLOCK_STATUS without a context.
    c.go("e");
    let r = c.block_status(0, 0, 4096);
    assert_eq!((r.len(), r[0].0, r[0].1), (1, REPLY_TYPE_ERROR, EINVAL));
}

#[test]
fn block_status_reports_holes_and_data_and_honours_req_one() {
    let f = serve();
    let mut c = Client::open(&f.addr);
    c.option(OPT_STRUCTURED_REPLY, &[]);
    c.option(OPT_SET_META_CONTEXT, &encode_meta_request("d", &["base:allocation"]));
    // A later failed SET replaces the selection: nothing selected.
    let mut bad = encode_meta_request("d", &["base:allocation"]);
    bad.truncate(bad.len() - 1);
    assert_eq!(c.option(OPT_SET_META_CONTEXT, &bad)[0].0, REP_ERR_INVALID);
    c.option(OPT_SET_META_CONTEXT, &encode_meta_request("d", &["base:allocation"]));
    c.go("d");

    let whole = c.block_status(0, 0, SIZE as u32);
    assert_eq!(whole.len(), 1);
    let (kind, id, descs) = &whole[0];
    assert_eq!((*kind, *id), (REPLY_TYPE_BLOCK_STATUS, 1));
    let hz = STATE_HOLE | STATE_ZERO;
    assert_eq!(descs, &[(1 << 20, hz), (64 << 10, 0), ((7 << 20) - (64 << 10), hz), (4096, 0), ((8 << 20) - 4096, hz)]);
    // REQ_ONE: exactly one descriptor, inside the request.
    let one = c.block_status(CMD_FLAG_REQ_ONE, (1 << 20) + 4096, 1 << 20);
    assert_eq!(one[0].2, [((64 << 10) - 4096, 0)]);
    let one = c.block_status(CMD_FLAG_REQ_ONE, 0, 4096);
    assert_eq!(one[0].2, [(4096, hz)]);
    // Past the end, zero length, a flag BLOCK_STATUS does not take: EINVAL, connection stays.
    for (flags, off, len) in [(0, SIZE - 4096, 8192), (0, 0, 0), (CMD_FLAG_FUA, 0, 4096)] {
        let r = c.block_status(flags, off, len);
        assert_eq!((r[0].0, r[0].1), (REPLY_TYPE_ERROR, EINVAL), "{flags} {off} {len}");
    }
    assert_eq!(c.block_status(0, 8 << 20, 4096)[0].2, [(4096, 0)]);
    let stats = f.server.export_stats();
    let d = &stats.iter().find(|(n, _)| n == "d").unwrap().1;
    assert_eq!((d.block_status, d.errors), (4, 3), "{d:?}");
}

#[test]
fn nbdinfo_map_reads_the_same_map() {
    let f = serve();
    let out = Command::new("nbdinfo")
        .args(["--map", &format!("nbd://{}/d", f.addr)])
        .output()
        .expect("nbdinfo (Debian package libnbd-bin) must be installed");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let rows: Vec<Vec<&str>> = text.lines().map(|l| l.split_whitespace().collect()).collect();
    let expect = [
        ["0", "1048576", "3"],
        ["1048576", "65536", "0"],
        ["1114112", "7274496", "3"],
        ["8388608", "4096", "0"],
        ["8392704", "8384512", "3"],
    ];
    assert_eq!(rows.len(), expect.len(), "{text}");
    for (row, want) in rows.iter().zip(expect) {
        assert_eq!(&row[..3], want, "{text}");
    }
}

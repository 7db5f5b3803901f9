//! A deliberately small NBD client that writes protocol bytes by hand (independently of the
//! server's encoders), for sending malformed input and checking the exact replies.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
pub const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_MAGIC: u32 = 0x6744_6698;
pub const STRUCTURED_MAGIC: u32 = 0x668e_33ef;

pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_ERR_UNSUP: u32 = 0x8000_0001;
pub const REP_ERR_INVALID: u32 = 0x8000_0003;
pub const REP_ERR_UNKNOWN: u32 = 0x8000_0006;
pub const REP_ERR_TOO_BIG: u32 = 0x8000_0009;

pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_CACHE: u16 = 5;
pub const CMD_WRITE_ZEROES: u16 = 6;
pub const CMD_BLOCK_STATUS: u16 = 7;
pub const FLAG_FUA: u16 = 1;
pub const FLAG_NO_HOLE: u16 = 2;
pub const FLAG_FAST_ZERO: u16 = 16;

pub const EPERM: u32 = 1;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;
pub const EOVERFLOW: u32 = 75;
pub const ENOTSUP: u32 = 95;

pub struct Raw {
    pub s: TcpStream,
}

#[derive(Debug)]
pub struct Chunk {
    pub flags: u16,
    pub kind: u16,
    pub cookie: u64,
    pub payload: Vec<u8>,
}

impl Chunk {
    /// Error number of an error chunk.
    pub fn errno(&self) -> u32 {
        u32::from_be_bytes(self.payload[0..4].try_into().unwrap())
    }
    pub fn message(&self) -> String {
        let n = u16::from_be_bytes([self.payload[4], self.payload[5]]) as usize;
        String::from_utf8_lossy(&self.payload[6..6 + n]).into_owned()
    }
}

impl Raw {
    pub fn connect(addr: &str) -> Raw {
        let s = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        s.set_nodelay(true).unwrap();
        Raw { s }
    }

    pub fn send(&mut self, b: &[u8]) {
        self.s.write_all(b).expect("send");
    }

    pub fn recv(&mut self, n: usize) -> Vec<u8> {
        let mut v = vec![0u8; n];
        self.s.read_exact(&mut v).unwrap_or_else(|e| panic!("reading {n} bytes: {e}"));
        v
    }

    pub fn u16(&mut self) -> u16 {
        u16::from_be_bytes(self.recv(2).try_into().unwrap())
    }
    pub fn u32(&mut self) -> u32 {
        u32::from_be_bytes(self.recv(4).try_into().unwrap())
    }
    pub fn u64(&mut self) -> u64 {
        u64::from_be_bytes(self.recv(8).try_into().unwrap())
    }

    /// Reads the server greeting; returns the handshake flags.
    pub fn greeting(&mut self) -> u16 {
        assert_eq!(self.u64(), NBDMAGIC);
        assert_eq!(self.u64(), IHAVEOPT);
        self.u16()
    }

    /// Greeting + client flags (fixed newstyle, no zeroes).
    pub fn start(addr: &str) -> Raw {
        let mut r = Raw::connect(addr);
        let f = r.greeting();
        assert_eq!(f & 3, 3, "server must offer FIXED_NEWSTYLE and NO_ZEROES");
        r.send(&3u32.to_be_bytes());
        r
    }

    pub fn option(&mut self, opt: u32, data: &[u8]) {
        let mut b = IHAVEOPT.to_be_bytes().to_vec();
        b.extend_from_slice(&opt.to_be_bytes());
        b.extend_from_slice(&(data.len() as u32).to_be_bytes());
        b.extend_from_slice(data);
        self.send(&b);
    }

    /// One option reply: (option, reply type, data).
    pub fn option_reply(&mut self) -> (u32, u32, Vec<u8>) {
        assert_eq!(self.u64(), OPT_REPLY_MAGIC, "option reply magic");
        let opt = self.u32();
        let kind = self.u32();
        let len = self.u32() as usize;
        assert!(len < 1 << 20, "absurd option reply length {len}");
        (opt, kind, self.recv(len))
    }

    pub fn info_data(name: &str, requests: &[u16]) -> Vec<u8> {
        let mut d = (name.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(name.as_bytes());
        d.extend_from_slice(&(requests.len() as u16).to_be_bytes());
        for r in requests {
            d.extend_from_slice(&r.to_be_bytes());
        }
        d
    }

    /// Full handshake with NBD_OPT_GO; returns (size, transmission flags).
    pub fn go(&mut self, name: &str, structured: bool, block_size: bool) -> (u64, u16) {
        if structured {
            self.option(OPT_STRUCTURED_REPLY, &[]);
            assert_eq!(self.option_reply().1, REP_ACK);
        }
        let reqs: &[u16] = if block_size { &[3] } else { &[] };
        self.option(OPT_GO, &Raw::info_data(name, reqs));
        let (mut size, mut flags) = (None, 0);
        loop {
            let (opt, kind, data) = self.option_reply();
            assert_eq!(opt, OPT_GO);
            match kind {
                REP_INFO => {
                    if u16::from_be_bytes([data[0], data[1]]) == 0 {
                        size = Some(u64::from_be_bytes(data[2..10].try_into().unwrap()));
                        flags = u16::from_be_bytes([data[10], data[11]]);
                    }
                }
                REP_ACK => break,
                other => panic!("GO failed with reply type {other:#x}: {}", String::from_utf8_lossy(&data)),
            }
        }
        (size.expect("NBD_INFO_EXPORT"), flags)
    }

    /// Connects and enters transmission on `export`.
    pub fn open(addr: &str, export: &str, structured: bool, block_size: bool) -> Raw {
        let mut r = Raw::start(addr);
        r.go(export, structured, block_size);
        r
    }

    pub fn request(&mut self, flags: u16, kind: u16, cookie: u64, offset: u64, len: u32, payload: &[u8]) {
        let mut b = Vec::with_capacity(28 + payload.len());
        b.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        b.extend_from_slice(&flags.to_be_bytes());
        b.extend_from_slice(&kind.to_be_bytes());
        b.extend_from_slice(&cookie.to_be_bytes());
        b.extend_from_slice(&offset.to_be_bytes());
        b.extend_from_slice(&len.to_be_bytes());
        b.extend_from_slice(payload);
        self.send(&b);
    }

    /// A simple reply: (error, cookie).
    pub fn simple_reply(&mut self) -> (u32, u64) {
        let magic = self.u32();
        assert_eq!(magic, SIMPLE_MAGIC, "expected a simple reply, got magic {magic:#x}");
        (self.u32(), self.u64())
    }

    pub fn chunk(&mut self) -> Chunk {
        let magic = self.u32();
        assert_eq!(magic, STRUCTURED_MAGIC, "expected a structured chunk, got magic {magic:#x}");
        let flags = self.u16();
        let kind = self.u16();
        let cookie = self.u64();
        let len = self.u32() as usize;
        assert!(len <= (32 << 20) + 8, "absurd chunk length {len}");
        Chunk { flags, kind, cookie, payload: self.recv(len) }
    }

    /// Simple-reply write; returns the error.
    pub fn write(&mut self, cookie: u64, offset: u64, data: &[u8]) -> u32 {
        self.request(0, CMD_WRITE, cookie, offset, data.len() as u32, data);
        let (err, c) = self.simple_reply();
        assert_eq!(c, cookie);
        err
    }

    /// Simple-reply read; returns the data or the error.
    pub fn read(&mut self, cookie: u64, offset: u64, len: u32) -> Result<Vec<u8>, u32> {
        self.request(0, CMD_READ, cookie, offset, len, &[]);
        let (err, c) = self.simple_reply();
        assert_eq!(c, cookie);
        if err != 0 { Err(err) } else { Ok(self.recv(len as usize)) }
    }

    /// Asserts the server closes the connection (EOF or reset) without sending more.
    pub fn expect_closed(&mut self) {
        let mut b = [0u8; 64];
        match self.s.read(&mut b) {
            Ok(0) => {}
            Ok(n) => panic!("expected the server to close; got {n} more bytes: {:?}", &b[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
            Err(e) => panic!("expected the server to close; got {e}"),
        }
    }
}

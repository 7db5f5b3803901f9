//! Hostile arguments on the control socket. Every registered verb gets a table of malformed
//! requests (missing fields, wrong JSON types, absurd numbers, names with '/', NUL or newline,
//! unparsable sizes, paths that are not member files, the same file twice under two paths).
//! Each must be refused with `ok: false` and an error that names what is wrong, and after each
//! one the service still answers, nothing changed in the test directory (no new file, no state
//! file rewritten, the member files of the refused request byte-identical) and nothing appeared
//! outside it. At the end a mem volume and an md raid1 made at the start still serve their data
//! over NBD, and the thin pool still has only its configured device.

use crate::common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{SMALL_POOL, Server, nbd_read, nbd_write_at, pattern, sha256};
use serde_json::{Value, json};

/// A hang guard only: every answer here comes back in milliseconds.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(60);
const VICTIM_BYTES: usize = 4 << 20;

/// One JSON-lines control connection.
struct Ctl {
    w: UnixStream,
    r: BufReader<UnixStream>,
}

impl Ctl {
    fn connect(srv: &Server) -> Ctl {
        let w = UnixStream::connect(&srv.control).expect("connect control socket");
        w.set_read_timeout(Some(ANSWER_TIMEOUT)).unwrap();
        let r = BufReader::new(w.try_clone().unwrap());
        Ctl { w, r }
    }

    fn send_line(&mut self, line: &[u8]) -> Value {
        self.w.write_all(line).unwrap();
        self.w.write_all(b"\n").unwrap();
        let mut resp = String::new();
        let n = self.r.read_line(&mut resp).unwrap_or_else(|e| panic!("no answer (hang?) to {line:.200?}: {e}"));
        assert!(n > 0, "connection closed without an answer to {:.200}", String::from_utf8_lossy(line));
        serde_json::from_str(&resp).unwrap_or_else(|e| panic!("{e}: {resp:?}"))
    }

    fn call(&mut self, cmd: &str, args: Value) -> Value {
        self.send_line(json!({ "cmd": cmd, "args": args }).to_string().as_bytes())
    }
}

/// Names, lengths and (for small files) contents of everything under `dir`, except the log
/// and the NBD helpers' staging files. Large files (member and pool files) are compared by
/// length: their contents are checked by sha256 (victims) or by reading them back (NBD).
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, (u64, Option<Vec<u8>>)> {
    let mut out = BTreeMap::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            if name == "mdkit.log" || name.ends_with(".src") || name.ends_with(".dst") {
                continue;
            }
            let meta = std::fs::symlink_metadata(&p).unwrap();
            if meta.is_dir() {
                todo.push(p.clone());
            }
            let content = (meta.is_file() && meta.len() < 1 << 20).then(|| std::fs::read(&p).unwrap());
            out.insert(p, (meta.len(), content));
        }
    }
    out
}

/// Everything a refused request must leave as it was.
struct World<'a> {
    srv: &'a Server,
    outside: &'a Path,
    /// Member files refused requests name, with their contents.
    victims: Vec<(PathBuf, Vec<u8>)>,
    ctl: Ctl,
    cases: usize,
    /// How much of the service log was checked for panics.
    log_seen: usize,
    /// Everything that went wrong, reported together at the end.
    failures: Vec<String>,
}

impl World<'_> {
    /// Sends `cmd` with `args`, which must be refused with an error containing every string
    /// of `want`; then checks that the service answers and nothing changed on disk.
    fn refused(&mut self, cmd: &str, args: Value, want: &[&str]) {
        let before = snapshot(self.srv.dir.path());
        let shown = format!("{cmd} {:.200}", args.to_string());
        let v = self.ctl.call(cmd, args);
        self.cases += 1;
        match v["error"].as_str() {
            _ if v["ok"] != false => {
                self.failures.push(format!("{shown}: must be refused, got {:.160}", v.to_string()))
            }
            None => self.failures.push(format!("{shown}: no error text in {v}")),
            Some(e) if e.trim().is_empty() => self.failures.push(format!("{shown}: empty error")),
            Some(e) => {
                if let Some(w) = want.iter().find(|w| !e.contains(*w)) {
                    self.failures.push(format!("{shown}: error {e:?} should name {w:?}"));
                }
            }
        }
        self.still_fine(&shown);
        let after = snapshot(self.srv.dir.path());
        if before != after {
            let changed: Vec<_> =
                after.keys().chain(before.keys()).filter(|k| before.get(*k) != after.get(*k)).collect();
            self.failures.push(format!("{shown}: refused but changed the test directory: {changed:?}"));
        }
    }

    fn still_fine(&mut self, shown: &str) {
        let st = self.ctl.call("status", Value::Null);
        assert_eq!(st["ok"], true, "after {shown}: status: {st}");
        let log = self.srv.log_text();
        if log[self.log_seen.min(log.len())..].contains("panicked") {
            self.failures.push(format!("{shown}: the service panicked:\n{}", &log[self.log_seen.min(log.len())..]));
        }
        self.log_seen = log.len();
        for e in std::fs::read_dir(self.outside).unwrap() {
            let p = e.unwrap().path();
            self.failures.push(format!("{shown}: created {} outside the test directory", p.display()));
            let _ = std::fs::remove_dir_all(&p).or_else(|_| std::fs::remove_file(&p));
        }
        for (p, bytes) in &self.victims {
            if std::fs::read(p).unwrap() != *bytes {
                self.failures.push(format!("{shown}: {} changed", p.display()));
                std::fs::write(p, bytes).unwrap();
            }
        }
    }
}

/// Values of the wrong JSON type for any field.
fn wrong_types() -> Vec<Value> {
    vec![Value::Null, json!(true), json!(-1), json!(1.5e30), json!(["x"]), json!({ "nested": { "deeper": [1] } })]
}

/// Names no volume, array or pool may take.
fn bad_names() -> Vec<String> {
    ["", "a/b", "..", "../escape", "a\0b", "a\nb", "spa ce", "ünï"]
        .iter()
        .map(|s| s.to_string())
        .chain(["x".repeat(65), "y".repeat(60_000)])
        .collect()
}

#[test]
fn hostile_control_arguments_are_refused_and_harm_nothing() {
    let srv = Server::start(&format!(
        "[[volume]]\nname = \"ram\"\nkind = \"mem\"\nsize = \"8MiB\"\n[[export]]\nname = \"ram\"\nvolume = \"ram\"\n{SMALL_POOL}"
    ));
    let outside_dir = tempfile::Builder::new().prefix("mdkit-hostile-outside-").tempdir_in("/var/tmp").unwrap();
    let outside = outside_dir.path();
    let data = srv.dir.path().to_path_buf();

    // The healthy volumes: the mem volume and an md raid1 made over the control socket.
    let mut ctl = Ctl::connect(&srv);
    let v = ctl.call(
        "md.create",
        json!({ "name": "h0", "members": ["h0-a.img", "h0-b.img"], "level": "raid1",
                "member_size_bytes": 16 << 20, "export": "h0", "assume_clean": true }),
    );
    assert_eq!(v["ok"], true, "{v}\n{}", srv.log_text());
    let (ram_data, md_data) = (pattern(1, 1 << 20), pattern(2, 1 << 20));
    nbd_write_at(&srv, "ram", 0, &ram_data);
    nbd_write_at(&srv, "h0", 0, &md_data);

    // Files hostile requests name as members; they hold data and no superblock.
    let (va, vb) = (data.join("va.img"), data.join("vb.img"));
    std::fs::write(&va, pattern(3, VICTIM_BYTES)).unwrap();
    std::fs::write(&vb, pattern(4, VICTIM_BYTES)).unwrap();
    std::fs::create_dir(data.join("adir")).unwrap();
    let sums = [sha256(&va), sha256(&vb)];
    let victims = vec![(va.clone(), pattern(3, VICTIM_BYTES)), (vb.clone(), pattern(4, VICTIM_BYTES))];
    let mut w = World { srv: &srv, outside, victims, ctl, cases: 0, log_seen: 0, failures: Vec::new() };

    whole_requests(&mut w);
    argless_verbs(&mut w);
    md_create(&mut w, &data);
    md_assemble(&mut w);
    md_named(&mut w);
    md_manage(&mut w, &data);
    md_grow(&mut w);
    md_attr(&mut w);
    thin_pool_create(&mut w, &data);
    thin_pool_verbs(&mut w);
    thin_devices(&mut w);
    thin_pool_resize(&mut w);
    monitor(&mut w);
    assert!(w.failures.is_empty(), "{} of {} cases failed:\n{}", w.failures.len(), w.cases, w.failures.join("\n"));

    // The healthy volumes still serve their data; the pool still has only device 0.
    assert_eq!(nbd_read(&srv, "ram", ram_data.len()), ram_data);
    assert_eq!(nbd_read(&srv, "h0", md_data.len()), md_data);
    let list = w.ctl.call("thin.list", json!({ "pool": "pool0" }));
    assert_eq!(list["result"]["thins"].as_array().map(Vec::len), Some(1), "{list}");
    let detail = w.ctl.call("md.detail", json!({ "name": "h0" }));
    assert_eq!(detail["ok"], true, "{detail}");
    assert_eq!([sha256(&va), sha256(&vb)], sums, "member files of refused requests changed");
    assert!(!srv.log_text().contains("panicked"));
    assert!(w.cases > 300, "only {} cases ran", w.cases);
}

/// Request lines that are not a `{"cmd", "args"}` object.
fn whole_requests(w: &mut World) {
    for line in
        [&b"{}"[..], b"[]", b"null", b"{\"cmd\": 5}", b"{\"cmd\": null}", b"{\"cmd\": [\"status\"]}", b"\"status\""]
    {
        let v = w.ctl.send_line(line);
        assert_eq!(v["ok"], false, "{}: {v}", String::from_utf8_lossy(line));
        assert!(v["error"].as_str().unwrap().contains("malformed request"), "{v}");
    }
    w.refused("status\0", json!({}), &["unknown command"]);
    w.refused("", json!({}), &["unknown command"]);
    w.refused(&"s".repeat(60_000), json!({}), &["unknown command"]);
}

/// Verbs without arguments refuse any.
fn argless_verbs(w: &mut World) {
    for cmd in ["status", "md.list", "help"] {
        for args in [json!({ "bogus": 1 }), json!(["x"]), json!("x"), json!(5), json!({ "name": "h0" })] {
            w.refused(cmd, args, &[cmd, "argument"]);
        }
        for args in [Value::Null, json!({})] {
            assert_eq!(w.ctl.call(cmd, args)["ok"], true);
        }
    }
}

fn md_create(w: &mut World, data: &Path) {
    let base = json!({ "name": "hx", "members": ["va.img", "vb.img"], "level": "raid1" });
    let with = |k: &str, v: Value| {
        let mut a = base.clone();
        a[k] = v;
        a
    };
    let without = |k: &str| {
        let mut a = base.clone();
        a.as_object_mut().unwrap().remove(k);
        a
    };
    for k in ["name", "members", "level"] {
        w.refused("md.create", without(k), &[k]);
    }
    for args in [json!([]), json!("hx"), json!(5)] {
        w.refused("md.create", args, &["md.create: arguments must be a JSON object"]);
    }
    w.refused("md.create", with("bogus", json!(1)), &["bogus"]);
    for k in ["name", "members", "level", "raid_devices", "chunk_kib", "bitmap", "bitmap_chunk_bytes", "metadata"] {
        for v in wrong_types() {
            if (v.is_null() && !["name", "members", "level"].contains(&k)) || (k == "members" && v.is_array()) {
                continue; // null is "not given" for optional fields
            }
            w.refused("md.create", with(k, v), &["md.create: bad arguments", &format!("`{k}")]);
        }
    }
    for n in bad_names() {
        w.refused("md.create", with("name", json!(n)), &["array name"]);
    }
    w.refused("md.create", with("name", json!("ram")), &["\"ram\" already exists"]);
    for l in ["raid7", "", "raid1\0", "linear-ish", "x".repeat(5000).as_str()] {
        w.refused("md.create", with("level", json!(l)), &["level"]);
    }
    for n in [json!(0), json!(3), json!(100_000)] {
        w.refused("md.create", with("raid_devices", n), &["raid"]);
    }
    for n in [json!(-1), json!(u64::MAX), json!(1u64 << 63)] {
        w.refused("md.create", with("raid_devices", n.clone()), &["bad arguments: `raid_devices`", &n.to_string()]);
    }
    let raid0 = |k: &str, v: Value| {
        let mut a = with("level", json!("raid0"));
        a[k] = v;
        a
    };
    for c in [json!(3), json!(1000), json!(u32::MAX)] {
        w.refused("md.create", raid0("chunk_kib", c), &["chunk"]);
    }
    for c in [json!(-1), json!("64")] {
        w.refused("md.create", raid0("chunk_kib", c), &["md.create: bad arguments: `chunk_kib`"]);
    }
    for (k, v, want) in [
        ("bitmap", json!("external"), "bitmap"),
        ("bitmap", json!(""), "bitmap"),
        ("bitmap_chunk_bytes", json!(3), "bitmap chunk"),
        ("bitmap_chunk_bytes", json!(1), "bitmap chunk"),
        ("bitmap_chunk_bytes", json!(u32::MAX), "bitmap chunk"),
        ("bitmap_chunk_bytes", json!(u64::MAX), "bad arguments: `bitmap_chunk_bytes`"),
        ("metadata", json!("0.90"), "metadata"),
        ("metadata", json!("9"), "metadata"),
        ("layout", json!("bogus"), "layout"),
        ("write_behind", json!(u32::MAX), "write-behind"),
        ("write_behind", json!(-1), "bad arguments: `write_behind`"),
        ("force", json!("yes"), "bad arguments: `force`"),
        ("assume_clean", json!(1), "bad arguments: `assume_clean`"),
        ("export", json!("a\0b"), "export"),
        ("export", json!(""), "export"),
        ("export", json!("ram"), "export"),
        ("export", json!("e".repeat(5000)), "export"),
    ] {
        w.refused("md.create", with(k, v), &[want]);
    }
    w.refused("md.create", raid0("bitmap_chunk_bytes", json!(65536)), &["bitmap chunk"]);
    // Members that cannot be (or must not be two) members.
    let sock = w.srv.control.display().to_string();
    let abs_va = data.join("va.img").display().to_string();
    let escape = format!("../{}/esc.img", w.outside.file_name().unwrap().to_string_lossy());
    for (members, want) in [
        (json!("va.img"), "bad arguments: `members`"),
        (json!([]), "no members"),
        (json!([1, 2]), "bad arguments: `members[0]`"),
        (json!(["va.img", null]), "bad arguments: `members[1]`"),
        (json!(["va.img", ""]), "member"),
        (json!(["va.img", "va.img"]), "va.img"),
        (json!(["va.img", "./va.img"]), "va.img"),
        (json!(["va.img", abs_va]), "va.img"),
        (json!(["va.img", "vb.img", "adir/../va.img"]), "va.img"),
        (json!(["va.img", "missing.img"]), "missing.img"),
        (json!(["va.img", "/dev/null"]), "/dev/null"),
        (json!(["va.img", "adir"]), "adir"),
        (json!(["va.img", sock]), "mdkit.sock"),
        (json!(["va.img", "volume:nope"]), "nope"),
        (json!(["va.img", "volume:pool0"]), "is a thin pool, not a block device"),
        (json!(["va.img", "a\0b"]), "does not exist"),
        (json!(["va.img", "h0-a.img"]), "h0-a.img"),
        (json!(["va.img", "./h0-a.img"]), "h0-a.img"),
        (json!(["va.img", escape]), "esc.img"),
        (json!(["va.img", w.outside.join("abs.img")]), "abs.img"),
        (json!(["nbd://127.0.0.1:1/x", "va.img"]), "remote"),
        (json!(vec!["nope.img"; 5000]), "nope.img"),
    ] {
        w.refused("md.create", with("members", members), &[want]);
    }
    // Sizes of member files to create: none may be left behind by a refused create.
    let new = |size: Value, extra: (&str, Value)| {
        let mut a = with("members", json!(["new-a.img", w.outside.join("new-b.img"), escape]));
        a["member_size_bytes"] = size;
        if !extra.0.is_empty() {
            a[extra.0] = extra.1;
        }
        a
    };
    for s in [json!(0), json!(1), json!(511), json!(u64::MAX), json!(1u64 << 63), json!(1u64 << 62)] {
        w.refused("md.create", new(s.clone(), ("", Value::Null)), &[&s.to_string()]);
    }
    for s in [json!(-1), json!("1G"), json!("999999999999T"), json!(1e30), json!([1])] {
        w.refused("md.create", new(s, ("", Value::Null)), &["md.create: bad arguments: `member_size_bytes`"]);
    }
    w.refused("md.create", new(json!(4096), ("", Value::Null)), &["too small"]);
    for extra in [("level", json!("raid9")), ("chunk_kib", json!(3)), ("name", json!("a/b")), ("export", json!("\0"))] {
        w.refused("md.create", new(json!(16 << 20), extra.clone()), &[extra.0.split('_').next().unwrap()]);
    }
}

fn md_assemble(w: &mut World) {
    let base = json!({ "name": "hx", "members": ["va.img", "vb.img"] });
    let with = |k: &str, v: Value| {
        let mut a = base.clone();
        a[k] = v;
        a
    };
    w.refused("md.assemble", json!({ "name": "hx" }), &["members"]);
    w.refused("md.assemble", json!({ "members": ["va.img"] }), &["name"]);
    w.refused("md.assemble", base.clone(), &["superblock"]);
    for n in bad_names() {
        w.refused("md.assemble", with("name", json!(n)), &["array name"]);
    }
    for u in ["zz", "", "0123", &"f".repeat(33), &"0".repeat(10_000)] {
        w.refused("md.assemble", with("uuid", json!(u)), &["uuid"]);
    }
    for (k, v) in [("uuid", json!(5)), ("run", json!("yes")), ("force", json!([])), ("members", json!({}))] {
        w.refused("md.assemble", with(k, v), &["md.assemble: bad arguments", &format!("`{k}`")]);
    }
    for m in [json!(["va.img", "va.img"]), json!(["va.img", "./va.img"]), json!(["h0-a.img"]), json!(["/dev/null"])] {
        w.refused("md.assemble", with("members", m), &[]);
    }
    w.refused("md.assemble", with("members", json!(["missing.img"])), &["missing.img"]);
}

/// `md.detail` and `md.stop`: the name alone.
fn md_named(w: &mut World) {
    for cmd in ["md.detail", "md.stop"] {
        w.refused(cmd, json!({}), &["name"]);
        w.refused(cmd, json!([]), &["arguments"]);
        w.refused(cmd, json!({ "name": "h0", "bogus": 1 }), &["bogus"]);
        for v in wrong_types() {
            w.refused(cmd, json!({ "name": v }), &[&format!("{cmd}: bad arguments: `name`")]);
        }
        for n in bad_names() {
            w.refused(cmd, json!({ "name": n }), &["no volume named"]);
        }
        w.refused(cmd, json!({ "name": "ram" }), &["not an md array"]);
        w.refused(cmd, json!({ "name": "pool0" }), &["not an md array"]);
    }
}

fn md_manage(w: &mut World, data: &Path) {
    let m = |action: &str, member: &str| json!({ "name": "h0", "action": action, "member": member });
    w.refused("md.manage", json!({ "name": "h0", "action": "add" }), &["member"]);
    w.refused("md.manage", json!({ "name": "h0", "member": "va.img" }), &["action"]);
    w.refused("md.manage", json!({ "action": "add", "member": "va.img" }), &["name"]);
    for a in ["explode", "", "ADD", "add\0", &"a".repeat(10_000)] {
        w.refused("md.manage", m(a, "va.img"), &["action"]);
    }
    for v in wrong_types() {
        w.refused("md.manage", json!({ "name": "h0", "action": v, "member": "va.img" }), &["bad arguments: `action`"]);
        w.refused("md.manage", json!({ "name": "h0", "action": "add", "member": v }), &["bad arguments: `member`"]);
    }
    w.refused(
        "md.manage",
        m("add", "va.img")
            .as_object()
            .cloned()
            .map(|mut o| {
                o.insert("write_mostly".into(), json!("yes"));
                Value::Object(o)
            })
            .unwrap(),
        &["md.manage: bad arguments: `write_mostly`"],
    );
    for who in ["nope", "", "../h0-a.img", "a\0b", &"m".repeat(20_000)] {
        w.refused("md.manage", m("fail", who), &["no member"]);
        w.refused("md.manage", m("remove", who), &["no member"]);
        w.refused("md.manage", m("replace", who), &["no member"]);
    }
    let sock = w.srv.control.display().to_string();
    let abs = data.join("h0-a.img").display().to_string();
    for (who, want) in [
        ("h0-a.img", "h0-a.img"),
        ("./h0-a.img", "h0-a.img"),
        (abs.as_str(), "h0-a.img"),
        ("adir/../h0-b.img", "h0-b.img"),
        ("/dev/null", "/dev/null"),
        ("adir", "adir"),
        (sock.as_str(), "mdkit.sock"),
        ("missing.img", "missing.img"),
        ("volume:h0", "h0"),
        ("volume:nope", "nope"),
    ] {
        w.refused("md.manage", m("add", who), &[want]);
        w.refused("md.manage", m("re-add", who), &[want]);
    }
    for size in [json!(1), json!(u64::MAX), json!(1u64 << 63), json!(-1), json!("1G")] {
        let mut a = m("add", "new-spare.img");
        a["member_size_bytes"] = size.clone();
        w.refused("md.manage", a, &[size.as_str().unwrap_or(&size.to_string())]);
    }
    let mut a = m("replace", "h0-a.img");
    a["with"] = json!("./h0-b.img");
    w.refused("md.manage", a, &["h0-b.img"]);
    w.refused("md.manage", json!({ "name": "ram", "action": "add", "member": "va.img" }), &["not an md array"]);
}

fn md_grow(w: &mut World) {
    let g = |k: &str, v: Value| json!({ "name": "h0", k: v });
    w.refused("md.grow", json!({ "name": "h0" }), &["give one of"]);
    w.refused("md.grow", json!({ "size": "max" }), &["name"]);
    for v in [json!(0), json!(1000), json!(-1), json!(1e30), json!("999999999999T"), json!("1e30"), json!([1])] {
        w.refused("md.grow", g("size", v), &["size"]);
    }
    for v in [json!(u64::MAX - 1023), json!(1u64 << 63), json!(1u64 << 62)] {
        w.refused("md.grow", g("size", v), &["size"]);
    }
    for v in [json!(0), json!(100_000), json!(u32::MAX)] {
        w.refused("md.grow", g("raid_devices", v), &["raid"]);
    }
    for v in [json!(-1), json!(u64::MAX), json!("3"), json!(5.5)] {
        w.refused("md.grow", g("raid_devices", v), &["md.grow: bad arguments: `raid_devices`"]);
    }
    for v in [json!("bogus"), json!("")] {
        w.refused("md.grow", g("bitmap", v), &["bitmap"]);
    }
    for v in [json!(3), json!(u64::MAX), json!(0)] {
        w.refused("md.grow", json!({ "name": "h0", "bitmap": "internal", "bitmap_chunk_bytes": v }), &["bitmap"]);
    }
    for v in [json!(3), json!(0), json!(u32::MAX)] {
        w.refused("md.grow", g("chunk_kib", v), &["chunk"]);
    }
    for (k, v) in
        [("chunk_kib", json!(-1)), ("bitmap", json!(5)), ("write_behind", json!(-1)), ("write_behind", json!("4"))]
    {
        w.refused("md.grow", g(k, v), &["md.grow: bad arguments", &format!("`{k}`")]);
    }
    for v in ["raid9", "", "raid1\n"] {
        w.refused("md.grow", g("level", json!(v)), &["level"]);
    }
    w.refused("md.grow", g("layout", json!("bogus")), &["layout"]);
    for v in [json!(0), json!(1), json!(-1), json!("huge"), json!(u64::MAX), json!(1u64 << 63), json!(1e30)] {
        w.refused("md.grow", g("array_size", v), &["array size"]);
    }
    w.refused("md.grow", g("write_behind", json!(u32::MAX)), &["write"]);
    let add = |m: Value| json!({ "name": "h0", "raid_devices": 3, "add": m });
    for m in [json!(["/dev/null"]), json!(["h0-a.img"]), json!(["./h0-b.img"]), json!(["missing.img"]), json!("va.img")]
    {
        w.refused("md.grow", add(m), &[]);
    }
    w.refused("md.grow", json!({ "name": "h0", "size": "max", "bogus": 1 }), &["bogus"]);
    w.refused("md.grow", json!({ "name": "ram", "size": "max" }), &["not an md array"]);
}

fn md_attr(w: &mut World) {
    let a = |k: &str, v: &str| json!({ "name": "h0", "key": k, "value": v });
    for k in ["bogus", "", "../../etc/passwd", "a\0b", "dev-nope/state", &"k".repeat(30_000)] {
        w.refused("md.attr", json!({ "name": "h0", "key": k }), &["attribute"]);
        w.refused("md.attr", a(k, "1"), &[]);
    }
    for (k, v) in [
        ("sync_action", "explode"),
        ("sync_action", ""),
        ("sync_speed_max", "-1"),
        ("sync_speed_max", "99999999999999999999999"),
        ("sync_speed_max", "1e30"),
        ("sync_speed_min", "fast"),
        ("stripe_cache_size", "4096"),
        ("array_state", "nonsense"),
        ("bitmap/chunksize", "3"),
        ("level", "raid9"),
        ("raid_disks", "100000"),
        ("component_size", "18446744073709551615"),
    ] {
        w.refused("md.attr", a(k, v), &[k]);
    }
    for v in wrong_types().into_iter().filter(|v| !v.is_null()) {
        w.refused("md.attr", json!({ "name": "h0", "key": v }), &["md.attr: bad arguments: `key`"]);
        w.refused("md.attr", json!({ "name": "h0", "key": "sync_action", "value": v }), &["bad arguments: `value`"]);
    }
}

fn thin_pool_create(w: &mut World, data: &Path) {
    let base = json!({ "name": "tpx", "metadata": "tpx.meta", "metadata_size": "8M",
                       "data": w.outside.join("tpx.data"), "data_size": "64M" });
    let with = |k: &str, v: Value| {
        let mut a = base.clone();
        a[k] = v;
        a
    };
    for args in [json!([]), json!("tpx"), Value::Null] {
        w.refused("thin.pool-create", args, &["arguments"]);
    }
    for k in ["name", "metadata", "data"] {
        let mut a = base.clone();
        a.as_object_mut().unwrap().remove(k);
        w.refused("thin.pool-create", a, &[k]);
    }
    for n in bad_names() {
        w.refused("thin.pool-create", with("name", json!(n)), &["name"]);
    }
    for n in ["pool0", "ram", "h0"] {
        w.refused("thin.pool-create", with("name", json!(n)), &["already exists"]);
    }
    for v in wrong_types().into_iter().filter(|v| !v.is_null()) {
        w.refused("thin.pool-create", with("name", v.clone()), &["name"]);
        if v != json!(true) {
            w.refused("thin.pool-create", with("force", v.clone()), &["force"]);
        }
        w.refused("thin.pool-create", with("metadata", v.clone()), &["bad arguments: `metadata`"]);
        w.refused("thin.pool-create", with("options", v), &[]);
    }
    for s in ["-1", "1e30", "999999999999T", "8Q", "", "0x10", "8.5M"] {
        w.refused("thin.pool-create", with("metadata_size", json!(s)), &["size"]);
        w.refused("thin.pool-create", with("data_size", json!(s)), &["size"]);
        w.refused("thin.pool-create", with("block_size", json!(s)), &["size"]);
    }
    for s in [json!(0), json!(1), json!(511), json!(u64::MAX), json!(1u64 << 63), json!(1u64 << 60), json!("17T")] {
        w.refused("thin.pool-create", with("metadata_size", s.clone()), &["size"]);
        w.refused("thin.pool-create", with("data_size", s), &["size"]);
    }
    for s in
        [json!(0), json!(3), json!(1000), json!(32768), json!(65537), json!(u64::MAX), json!(1u64 << 63), json!("2T")]
    {
        w.refused("thin.pool-create", with("block_size", s), &["block_size"]);
    }
    let sock = w.srv.control.display().to_string();
    for (k, v, want) in [
        ("data", json!("tpx.meta"), "tpx.meta"),
        ("data", json!("./tpx.meta"), "tpx.meta"),
        ("metadata", json!("/dev/null"), "/dev/null"),
        ("metadata", json!("adir"), "adir"),
        ("metadata", json!(sock), "mdkit.sock"),
        ("metadata", json!("volume:nope"), "nope"),
        ("metadata", json!("volume:pool0"), "pool0"),
        ("metadata", json!("va.img"), "va.img"),
        ("metadata", json!("h0-a.img"), "h0-a.img"),
        ("metadata", json!("pool0.meta"), "pool0.meta"),
        ("metadata", json!(""), "Is a directory"),
        ("metadata", json!("a\0b"), "NUL"),
        ("options", json!(["bogus"]), "bogus"),
        ("options", json!("skip_block_zeroing"), "bad arguments"),
        ("no_space_timeout_s", json!(0), "no_space_timeout_s"),
        ("no_space_timeout_s", json!(u64::MAX), "no_space_timeout_s"),
        ("commit_interval_ms", json!(0), "commit_interval_ms"),
        ("queue_depth", json!(0), "queue_depth"),
        ("queue_depth", json!(u32::MAX), "queue_depth"),
        ("autoextend_threshold_percent", json!(0), "autoextend"),
        ("autoextend_threshold_percent", json!(u64::MAX), "autoextend"),
        ("autoextend_step", json!("bogus"), "autoextend"),
        ("create", json!(true), "create"),
        ("bogus", json!(1), "bogus"),
    ] {
        w.refused("thin.pool-create", with(k, v), &[want]);
    }
    let _ = data;
}

/// Verbs that take a pool name only (and `thin.dump` / `thin.delta` with a little more).
fn thin_pool_verbs(w: &mut World) {
    for cmd in ["thin.status", "thin.list", "thin.reserve-metadata-snap", "thin.release-metadata-snap", "thin.dump"] {
        w.refused(cmd, json!({}), &["pool"]);
        w.refused(cmd, json!([]), &["arguments must be a JSON object"]);
        w.refused(cmd, json!({ "pool": "pool0", "bogus": 1 }), &["bogus"]);
        for v in wrong_types() {
            w.refused(cmd, json!({ "pool": v }), &[&format!("{cmd}: bad arguments: `pool`")]);
        }
        for n in bad_names() {
            w.refused(cmd, json!({ "pool": n }), &["no thin pool named"]);
        }
        for n in ["vol0", "ram", "h0"] {
            w.refused(cmd, json!({ "pool": n }), &[n]);
        }
    }
    w.refused("thin.release-metadata-snap", json!({ "pool": "pool0" }), &["metadata snap"]);
    w.refused("thin.dump", json!({ "pool": "pool0", "metadata_snap": true }), &["metadata snap"]);
    w.refused(
        "thin.dump",
        json!({ "pool": "pool0", "metadata_snap": "yes" }),
        &["thin.dump: bad arguments: `metadata_snap`"],
    );
    let d = |l: Value, r: Value| json!({ "pool": "pool0", "left": l, "right": r });
    w.refused("thin.delta", json!({ "pool": "pool0", "left": 0 }), &["right"]);
    for v in [json!(-1), json!("0"), json!(1.5), Value::Null, json!([0])] {
        w.refused("thin.delta", d(json!(0), v), &["thin.delta: bad arguments: `right`"]);
    }
    for v in [json!(77), json!(u64::MAX), json!(1u64 << 63), json!(1u64 << 24)] {
        w.refused("thin.delta", d(json!(0), v.clone()), &[&v.to_string()]);
    }
}

/// `thin.create`, `snapshot`, `delete`, `activate`, `deactivate`.
fn thin_devices(w: &mut World) {
    let base = json!({ "pool": "pool0", "id": 5, "size": "16M" });
    let with = |k: &str, v: Value| {
        let mut a = base.clone();
        a[k] = v;
        a
    };
    w.refused("thin.create", json!({ "pool": "pool0", "id": 5 }), &["size"]);
    w.refused("thin.create", json!({ "pool": "pool0", "size": "16M" }), &["id"]);
    w.refused("thin.create", json!({ "id": 5, "size": "16M" }), &["pool"]);
    w.refused("thin.create", with("origin", json!(0)), &["origin"]);
    w.refused("thin.create", with("id", json!(0)), &["0"]);
    for v in [json!(-1), json!("5"), json!(1.5), json!([5]), json!({ "id": 5 })] {
        w.refused("thin.create", with("id", v), &["thin.create: bad arguments: `id`"]);
    }
    for v in [json!(u64::MAX), json!(1u64 << 63), json!(1u64 << 24)] {
        w.refused("thin.create", with("id", v.clone()), &[&v.to_string()]);
    }
    for v in [json!(0), json!(1), json!(511), json!(u64::MAX), json!(1u64 << 63), json!("0"), json!("8E")] {
        w.refused("thin.create", with("size", v), &["size"]);
    }
    for v in [json!(-1), json!("-1"), json!("1e30"), json!("999999999999T"), json!(1e30), json!([1])] {
        w.refused("thin.create", with("size", v), &["size"]);
    }
    for n in bad_names() {
        w.refused("thin.create", with("name", json!(n)), &["name"]);
    }
    for n in ["ram", "h0", "pool0", "vol0"] {
        w.refused("thin.create", with("name", json!(n)), &["already exists"]);
    }
    for e in ["a\0b", &"e".repeat(5000), "ram", "vol0"] {
        w.refused("thin.create", with("export", json!(e)), &["export"]);
    }
    let sock = w.srv.control.display().to_string();
    for o in ["/dev/null", "adir", "missing.img", "volume:nope", sock.as_str(), "a\0b"] {
        w.refused("thin.create", with("external_origin", json!(o)), &["origin"]);
    }
    for n in ["nope", "vol0", "ram", "", "a/b"] {
        w.refused("thin.create", with("pool", json!(n)), &[&format!("{n:?}")]);
    }
    // Snapshots.
    let snap = |k: &str, v: Value| {
        let mut a = json!({ "pool": "pool0", "id": 6, "origin": 0 });
        a[k] = v;
        a
    };
    w.refused("thin.snapshot", json!({ "pool": "pool0", "id": 6 }), &["origin"]);
    w.refused("thin.snapshot", snap("id", json!(0)), &["0"]);
    w.refused("thin.snapshot", snap("external_origin", json!("va.img")), &["external_origin"]);
    for v in [json!(77), json!(u64::MAX), json!(1u64 << 24)] {
        w.refused("thin.snapshot", snap("origin", v.clone()), &[&v.to_string()]);
    }
    for v in [json!(-1), json!("0"), Value::Bool(true)] {
        w.refused("thin.snapshot", snap("origin", v), &["thin.snapshot: bad arguments: `origin`"]);
    }
    for v in [json!(0), json!(1), json!(u64::MAX), json!("1e30")] {
        w.refused("thin.snapshot", snap("size", v), &["size"]);
    }
    for n in bad_names() {
        w.refused("thin.snapshot", snap("name", json!(n)), &["name"]);
    }
    w.refused("thin.snapshot", snap("export", json!("a\0b")), &["export"]);
    // Delete, activate, deactivate.
    for cmd in ["thin.delete", "thin.activate", "thin.deactivate"] {
        w.refused(cmd, json!({ "pool": "pool0" }), &["id"]);
        w.refused(cmd, json!({ "id": 0 }), &["pool"]);
        for v in [json!(-1), json!("0"), Value::Null, json!([0])] {
            w.refused(cmd, json!({ "pool": "pool0", "id": v }), &[&format!("{cmd}: bad arguments: `id`")]);
        }
        for v in [json!(77), json!(u64::MAX), json!(1u64 << 63)] {
            w.refused(cmd, json!({ "pool": "pool0", "id": v }), &[&v.to_string()]);
        }
        for n in ["nope", "vol0", "ram", "", "a\0b"] {
            w.refused(cmd, json!({ "pool": n, "id": 0 }), &[&format!("{n:?}")]);
        }
    }
    w.refused("thin.delete", json!({ "pool": "pool0", "id": 0 }), &["config file"]);
    w.refused("thin.deactivate", json!({ "pool": "pool0", "id": 0 }), &["config file"]);
    w.refused("thin.activate", json!({ "pool": "pool0", "id": 0 }), &["already active"]);
    for n in bad_names() {
        w.refused("thin.activate", json!({ "pool": "pool0", "id": 0, "name": n }), &["already active"]);
    }
}

fn thin_pool_resize(w: &mut World) {
    let r = |k: &str, v: Value| json!({ "pool": "pool0", k: v });
    w.refused("thin.pool-resize", json!({}), &["pool"]);
    for k in ["data_size", "metadata_size"] {
        for v in ["-1", "1e30", "999999999999T", "", "big"] {
            w.refused("thin.pool-resize", r(k, json!(v)), &[k]);
        }
        for v in ["1", "4096", "1M"] {
            w.refused("thin.pool-resize", r(k, json!(v)), &["shrinking"]);
        }
        for v in [json!(5), json!(-1), json!([]), json!(true)] {
            w.refused("thin.pool-resize", r(k, v), &[&format!("thin.pool-resize: bad arguments: `{k}`")]);
        }
    }
    w.refused("thin.pool-resize", json!({ "pool": "vol0" }), &["vol0"]);
    w.refused("thin.pool-resize", json!({ "pool": "h0" }), &["h0"]);
}

fn monitor(w: &mut World) {
    for args in [json!({ "test": "yes" }), json!({ "test": 1 }), json!({ "bogus": 1 }), json!([]), json!("x")] {
        w.refused("monitor.oneshot", args.clone(), &["arguments"]);
        // The stream verb answers once and closes its connection.
        let mut c = Ctl::connect(w.srv);
        let v = c.call("monitor.stream", args);
        if v["ok"] != false || !v["error"].as_str().is_some_and(|e| e.contains("arguments")) {
            w.failures.push(format!("monitor.stream: must be refused naming its arguments, got {v}"));
        }
        w.still_fine("monitor.stream");
    }
}

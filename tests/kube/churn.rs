//! Gateway-pod churn on the real node: the gateway pod deleted and recreated again and again
//! while the consumer keeps a UDP stream through the tunnel to the offloaded pod and to the
//! private one; every datagram is counted where it arrives, inside the pods' namespaces. The
//! private pod never gets one; the offloaded pod gets the stream through every new gateway.

use std::net::UdpSocket;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;

const PORT: u16 = 9000;

/// Run `f` on a new thread inside the network namespace at `ns` (sockets it opens live there).
fn spawn_in<T: Send + 'static>(
    ns: &Path,
    f: impl FnOnce() -> T + Send + 'static,
) -> std::thread::JoinHandle<T> {
    let file = std::fs::File::open(ns).expect("netns");
    std::thread::spawn(move || {
        // SAFETY: setns on a valid namespace fd affects only this new thread.
        let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
        f()
    })
}

/// The stream: a sender in the consumer, a counting receiver in each pod.
pub(super) struct Stream {
    stop: Arc<AtomicBool>,
    /// Datagrams sent to each pod (web, db).
    pub sent: Arc<AtomicU64>,
    /// Datagrams received by the offloaded pod and by the private one.
    pub web: Arc<AtomicU64>,
    pub db: Arc<AtomicU64>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Stream {
    /// 200 datagrams a second to each pod.
    pub fn start(consumer: &Path, web: (&Path, &str), db: (&Path, &str)) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let sent = Arc::new(AtomicU64::new(0));
        let (wc, dc) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let mut threads = Vec::new();
        for ((ns, _), count) in [(web, wc.clone()), (db, dc.clone())] {
            let stop = stop.clone();
            let (tx, rx) = std::sync::mpsc::channel();
            threads.push(spawn_in(ns, move || {
                let sock = UdpSocket::bind(("0.0.0.0", PORT)).expect("bind in the pod");
                sock.set_read_timeout(Some(Duration::from_millis(100)))
                    .expect("timeout");
                let _ = tx.send(());
                let mut buf = [0u8; 64];
                while !stop.load(Ordering::Relaxed) {
                    if sock.recv(&mut buf).is_ok() {
                        count.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }));
            rx.recv_timeout(Duration::from_secs(5))
                .expect("the receiver bound");
        }
        // The private pod's receiver counts what reaches it: a few datagrams from the
        // offloaded pod, beside it on the node (not through the tunnel), must arrive; then its
        // count starts from 0.
        let dst = db.1.to_string();
        spawn_in(web.0, move || {
            let sock = UdpSocket::bind(("0.0.0.0", 0)).expect("bind in the web pod");
            for _ in 0..5 {
                let _ = sock.send_to(b"control", (dst.as_str(), PORT));
            }
        })
        .join()
        .expect("control sender");
        let deadline = Instant::now() + Duration::from_secs(5);
        while dc.load(Ordering::Relaxed) == 0 {
            assert!(
                Instant::now() < deadline,
                "the private pod's receiver counted nothing sent to it from beside it"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        std::thread::sleep(Duration::from_millis(200));
        dc.store(0, Ordering::Relaxed);
        let (s, n) = (stop.clone(), sent.clone());
        let dsts = [web.1.to_string(), db.1.to_string()];
        threads.push(spawn_in(consumer, move || {
            let sock = UdpSocket::bind((CONSUMER_POD, 0)).expect("bind in the consumer");
            let mut next = Instant::now();
            while !s.load(Ordering::Relaxed) {
                for d in &dsts {
                    // Unreachable while the tunnel has no route: counted as sent anyway (the
                    // datagram was offered; the private pod's count is what matters).
                    let _ = sock.send_to(b"peerwall-churn", (d.as_str(), PORT));
                }
                n.fetch_add(1, Ordering::Relaxed);
                next += Duration::from_millis(5);
                if let Some(d) = next.checked_duration_since(Instant::now()) {
                    std::thread::sleep(d);
                }
            }
        }));
        Self {
            stop,
            sent,
            web: wc,
            db: dc,
            threads,
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Delete the gateway pod (its Deployment creates the next one), not waiting for it to go.
pub(super) fn delete_gateway_pod(node: &Node, peer: &str) {
    node.kubectl_ok(&[
        "-n",
        &format!("liqo-tenant-{peer}"),
        "delete",
        "pod",
        "-l",
        "networking.liqo.io/component=gateway",
        "--wait=false",
    ]);
}

/// What a churn run measured (a row of docs/reliability.md).
#[derive(Debug, serde::Serialize)]
struct ChurnRow {
    backend: String,
    recreations: usize,
    /// Each new gateway pod: its namespace appearing → peerwall enforcing in it, ms.
    enforced_ms: Vec<u64>,
    sent_each: u64,
    offloaded_received: u64,
    private_received: u64,
}

/// Recreate the gateway pod `times` times under the stream; returns the last gateway. Every
/// new gateway must carry the stream to the offloaded pod, none may let one datagram reach the
/// private pod.
#[allow(clippy::too_many_arguments)]
pub(super) fn churn(
    node: &Node,
    consumer: &Consumer,
    peer: &str,
    key: &str,
    backend: &str,
    mut gw: Gateway,
    web: &(String, String),
    db: &(String, String),
    times: usize,
) -> Gateway {
    let cons = PathBuf::from(format!("/run/netns/{}", consumer.ns.name()));
    let web_ns = pod_netns(Path::new("/proc"), &web.0).expect("web pod namespace");
    let db_ns = pod_netns(Path::new("/proc"), &db.0).expect("db pod namespace");
    let stream = Stream::start(&cons, (&web_ns, &web.1), (&db_ns, &db.1));
    let mut enforced_ms = Vec::new();
    let started = Instant::now();
    for i in 0..times {
        delete_gateway_pod(node, peer);
        let (next, took) = bring_up_gateway(node, consumer, peer, key, backend, Some(&gw.uid));
        enforced_ms.push(took.as_millis() as u64);
        gw = next;
        // The stream flows through this gateway: new datagrams reach the offloaded pod.
        let before = stream.web.load(Ordering::Relaxed);
        wait(
            &format!("{backend}: the stream through gateway {} of {times}", i + 1),
            Duration::from_secs(30),
            || (stream.web.load(Ordering::Relaxed) > before + 20).then_some(()),
        );
        assert_eq!(
            stream.db.load(Ordering::Relaxed),
            0,
            "{backend}: the private pod was reached during gateway recreation {}",
            i + 1
        );
    }
    // Datagrams still in flight.
    std::thread::sleep(Duration::from_millis(500));
    let row = ChurnRow {
        backend: backend.to_string(),
        recreations: times,
        enforced_ms,
        sent_each: stream.sent.load(Ordering::Relaxed),
        offloaded_received: stream.web.load(Ordering::Relaxed),
        private_received: stream.db.load(Ordering::Relaxed),
    };
    drop(stream);
    eprintln!(
        "{backend}: {times} gateway recreations in {} s: {row:?}",
        started.elapsed().as_secs()
    );
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("reliability");
    std::fs::create_dir_all(&dir).expect("report dir");
    std::fs::write(
        dir.join(format!("churn-{backend}.json")),
        serde_json::to_string_pretty(&row).expect("json"),
    )
    .expect("write row");
    assert_eq!(
        row.private_received, 0,
        "{backend}: the private pod was reached: {row:?}"
    );
    gw
}

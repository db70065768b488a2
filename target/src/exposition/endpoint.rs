//! The opt-in Prometheus endpoint (`--metrics`): `GET /metrics`, one
//! request per connection.
//!
//! A scrape must always be answerable: a missed one fires RamslogDown, an
//! intermittent one resets every alert's `for:` timer. So no client can hold
//! the endpoint: each source address holds at most one connection, a
//! connection gets `HEAD_TIMEOUT` for its request head and `WRITE_TIMEOUT`
//! for the answer, and when every slot is taken a newcomer evicts the
//! oldest connection that has not sent a whole head (one that has is being
//! answered and is gone within its deadlines). The page is rendered by one
//! background task, never by a request: however many scrapes come, at most
//! one render runs, and each scrape gets a page whose render began after it
//! asked (so it shows everything that happened before the scrape).

use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use ipnet::IpNet;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify};
use tokio::time::Instant;

use super::{render, CONTENT_TYPE};
use crate::admission::in_networks;
use crate::exposition::Faces;

/// Sources served at once, one connection each.
const SLOTS: usize = 16;
/// Connections waiting for their source's slot (the one being answered).
const WAITERS: usize = 16;
/// Longest request head read.
const MAX_REQUEST: usize = 8 * 1024;
/// A client gets this long to send its whole request head…
const HEAD_TIMEOUT: Duration = Duration::from_millis(500);
/// …and this long to take the answer.
const WRITE_TIMEOUT: Duration = Duration::from_secs(1);
/// A connection waits this long for its source's slot.
const SLOT_WAIT: Duration = Duration::from_millis(1500);
/// A render that takes longer than this is answered 503.
const RENDER_WAIT: Duration = Duration::from_secs(1);

struct Slot {
    id: u64,
    source: IpAddr,
    since: Instant,
    /// Its whole request head arrived: it is being answered.
    answering: bool,
    evict: Arc<Notify>,
}

#[derive(Default)]
struct Slots {
    held: Vec<Slot>,
    waiting: usize,
    next_id: u64,
}

enum Admission {
    Admitted(u64, Arc<Notify>),
    /// The source's connection is being answered: try again shortly.
    Wait,
    /// Every slot is answering: close.
    Full,
}

impl Slots {
    fn admit(&mut self, source: IpAddr) -> Admission {
        let evict_at = if let Some(i) = self.held.iter().position(|s| s.source == source) {
            if self.held[i].answering {
                return Admission::Wait;
            }
            Some(i)
        } else if self.held.len() < SLOTS {
            None
        } else {
            match self
                .held
                .iter()
                .enumerate()
                .filter(|(_, s)| !s.answering)
                .min_by_key(|(_, s)| s.since)
            {
                Some((i, _)) => Some(i),
                None => return Admission::Full,
            }
        };
        if let Some(i) = evict_at {
            self.held.swap_remove(i).evict.notify_one();
        }
        self.next_id += 1;
        let evict = Arc::new(Notify::new());
        self.held.push(Slot {
            id: self.next_id,
            source,
            since: Instant::now(),
            answering: false,
            evict: evict.clone(),
        });
        Admission::Admitted(self.next_id, evict)
    }

    fn answering(&mut self, id: u64) {
        if let Some(s) = self.held.iter_mut().find(|s| s.id == id) {
            s.answering = true;
        }
    }

    fn release(&mut self, id: u64) {
        self.held.retain(|s| s.id != id);
    }
}

struct Endpoint {
    slots: Mutex<Slots>,
    /// The latest page and when its render began.
    page: watch::Receiver<Option<(Instant, Arc<String>)>>,
    wanted: Notify,
}

impl Endpoint {
    fn slots(&self) -> MutexGuard<'_, Slots> {
        self.slots.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A slot for `source`, waiting a little while its previous connection
    /// is answered; None when there is none to be had.
    async fn slot(&self, source: IpAddr) -> Option<(u64, Arc<Notify>)> {
        let deadline = Instant::now() + SLOT_WAIT;
        let mut waiting = false;
        let got = loop {
            let admission = self.slots().admit(source);
            match admission {
                Admission::Admitted(id, evict) => break Some((id, evict)),
                Admission::Full => break None,
                Admission::Wait if Instant::now() >= deadline => break None,
                Admission::Wait => {
                    if !waiting {
                        let mut slots = self.slots();
                        if slots.waiting >= WAITERS {
                            break None;
                        }
                        slots.waiting += 1;
                        waiting = true;
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        };
        if waiting {
            self.slots().waiting -= 1;
        }
        got
    }

    /// A page whose render began after this call: the renderer is asked,
    /// and renders again after the one under way if that began earlier.
    async fn page(&self) -> Option<Arc<String>> {
        let asked = Instant::now();
        let mut rx = self.page.clone();
        let deadline = asked + RENDER_WAIT;
        loop {
            self.wanted.notify_one();
            tokio::time::timeout_at(deadline, rx.changed())
                .await
                .ok()?
                .ok()?;
            if let Some((began, page)) = &*rx.borrow_and_update() {
                if *began >= asked {
                    return Some(page.clone());
                }
            }
        }
    }
}

/// Bind the endpoint; the spawned tasks serve it until the daemon exits.
/// Only sources in `allow` are answered (every source when it is empty);
/// others are closed at once, before they take a slot.
pub async fn serve(addr: SocketAddr, allow: Vec<IpNet>, faces: Faces) -> std::io::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    if !allow.is_empty() {
        let nets: Vec<String> = allow.iter().map(|n| n.to_string()).collect();
        tracing::info!(
            "metrics on http://{bound}/metrics for {} only",
            nets.join(", ")
        );
    } else if bound.ip().is_loopback() {
        tracing::info!("metrics on http://{bound}/metrics");
    } else {
        tracing::warn!(
            "metrics on http://{bound}/metrics, beyond this host: anyone who reaches it sees \
             target names, LUN sizes and load (limit it with --metrics-allow NETWORK)"
        );
    }
    let (publish, page) = watch::channel(None);
    let endpoint = Arc::new(Endpoint {
        slots: Mutex::default(),
        page,
        wanted: Notify::new(),
    });
    tokio::spawn(renderer(endpoint.clone(), faces, publish));
    tokio::spawn(async move {
        loop {
            let (stream, peer) = match listener.accept().await {
                Ok(c) => c,
                Err(e) => {
                    // Out of file descriptors and the like: back off, go on.
                    tracing::warn!("metrics: accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            if !allow.is_empty() && !in_networks(&allow, peer.ip()) {
                tracing::debug!(%peer, "metrics: not in --metrics-allow; closed");
                drop(stream);
                continue;
            }
            tokio::spawn(connection(endpoint.clone(), stream, peer.ip()));
        }
    });
    Ok(())
}

/// Renders a page whenever a request asks for one: reading
/// /proc and every LU's counters happens here, off the runtime's workers,
/// once however many scrapes wait for it.
async fn renderer(
    endpoint: Arc<Endpoint>,
    faces: Faces,
    publish: watch::Sender<Option<(Instant, Arc<String>)>>,
) {
    loop {
        endpoint.wanted.notified().await;
        let began = Instant::now();
        let f = faces.clone();
        match tokio::task::spawn_blocking(move || render(&f)).await {
            Ok(Ok(page)) => {
                publish.send_replace(Some((began, Arc::new(page))));
            }
            Ok(Err(e)) => tracing::warn!("metrics: cannot render the page: {e}"),
            Err(e) => tracing::warn!("metrics: the render failed: {e}"),
        }
    }
}

async fn connection(endpoint: Arc<Endpoint>, mut stream: TcpStream, source: IpAddr) {
    let Some((id, evict)) = endpoint.slot(source).await else {
        return;
    };
    let head = tokio::select! {
        head = tokio::time::timeout(HEAD_TIMEOUT, read_head(&mut stream)) => head,
        _ = evict.notified() => {
            endpoint.slots().release(id);
            return;
        }
    };
    endpoint.slots().answering(id);
    if let Ok(Ok(head)) = head {
        let _ = tokio::time::timeout(WRITE_TIMEOUT, answer(&endpoint, &mut stream, head)).await;
    }
    endpoint.slots().release(id);
}

/// What arrived of a request head.
enum Head {
    Complete(Vec<u8>),
    TooLong,
}

async fn read_head(stream: &mut TcpStream) -> std::io::Result<Head> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    let mut scanned = 0usize;
    while !head[scanned.saturating_sub(3)..]
        .windows(4)
        .any(|w| w == b"\r\n\r\n")
    {
        if head.len() >= MAX_REQUEST {
            return Ok(Head::TooLong);
        }
        scanned = head.len();
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        head.extend_from_slice(&buf[..n]);
    }
    Ok(Head::Complete(head))
}

/// One answer, then close.
async fn answer(endpoint: &Endpoint, stream: &mut TcpStream, head: Head) -> std::io::Result<()> {
    let head = match head {
        Head::Complete(head) => head,
        Head::TooLong => {
            let status = "431 Request Header Fields Too Large";
            return reply(stream, status, "text/plain", "", true).await;
        }
    };
    let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
    let mut parts = line.split(|&b| b == b' ');
    let (method, path) = (
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default(),
    );
    let path = path.split(|&b| b == b'?').next().unwrap_or_default();
    match (method, path) {
        (b"GET" | b"HEAD", b"/metrics") => match endpoint.page().await {
            Some(page) => reply(stream, "200 OK", CONTENT_TYPE, &page, method == b"GET").await,
            None => {
                let body = "the page could not be rendered in time\n";
                reply(stream, "503 Service Unavailable", "text/plain", body, true).await
            }
        },
        (b"GET" | b"HEAD", _) => {
            let body = "only /metrics is served here\n";
            reply(stream, "404 Not Found", "text/plain", body, true).await
        }
        _ => {
            let body = "GET /metrics\n";
            reply(stream, "405 Method Not Allowed", "text/plain", body, true).await
        }
    }
}

async fn reply(
    stream: &mut TcpStream,
    status: &str,
    ty: &str,
    body: &str,
    with_body: bool,
) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ty}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    if with_body {
        stream.write_all(body.as_bytes()).await?;
    }
    stream.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([192, 0, 2, last])
    }

    fn admitted(a: Admission) -> u64 {
        match a {
            Admission::Admitted(id, _) => id,
            _ => panic!("not admitted"),
        }
    }

    #[test]
    fn one_slot_per_source_and_the_oldest_idle_is_evicted() {
        let mut slots = Slots::default();
        let first = admitted(slots.admit(ip(1)));
        // The same source again: its idle connection makes way.
        let second = admitted(slots.admit(ip(1)));
        assert_eq!(slots.held.len(), 1);
        assert_ne!(first, second);
        slots.answering(second);
        assert!(matches!(slots.admit(ip(1)), Admission::Wait));
        for i in 2..=SLOTS as u8 {
            admitted(slots.admit(ip(i)));
        }
        assert_eq!(slots.held.len(), SLOTS);
        // Full: the oldest that has not sent a whole head goes (source 2;
        // source 1 is answering).
        admitted(slots.admit(ip(200)));
        assert!(slots.held.iter().all(|s| s.source != ip(2)));
        assert!(slots.held.iter().any(|s| s.source == ip(1)));
        // Every slot answering: a newcomer is closed.
        let ids: Vec<u64> = slots.held.iter().map(|s| s.id).collect();
        for id in ids {
            slots.answering(id);
        }
        assert!(matches!(slots.admit(ip(201)), Admission::Full));
        slots.release(second);
        admitted(slots.admit(ip(201)));
    }
}

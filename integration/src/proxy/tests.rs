use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

use super::FaultProxy;

/// An echo server on a free loopback port.
async fn echo() -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    addr
}

async fn round_trip(s: &mut TcpStream, bytes: &[u8]) -> Vec<u8> {
    s.write_all(bytes).await.unwrap();
    let mut back = vec![0; bytes.len()];
    s.read_exact(&mut back).await.unwrap();
    back
}

#[tokio::test]
async fn forwards_bytes_unchanged_both_ways() {
    let proxy = FaultProxy::start(echo().await).await.unwrap();
    let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
    let mut rng = fastrand::Rng::with_seed(7);
    let payload: Vec<u8> = (0..3 * 1024 * 1024).map(|_| rng.u8(..)).collect();
    let (mut r, mut w) = s.split();
    let send = async {
        w.write_all(&payload).await.unwrap();
    };
    let mut back = vec![0; payload.len()];
    let receive = async { r.read_exact(&mut back).await.unwrap() };
    tokio::join!(send, receive);
    assert!(back == payload, "3 MiB came back changed");
    assert_eq!(proxy.bytes_moved(), 2 * payload.len() as u64);
    assert_eq!(proxy.connections(), 1);
    drop(s);
    let deadline = Instant::now() + Duration::from_secs(5);
    while proxy.connections() != 0 {
        assert!(
            Instant::now() < deadline,
            "a closed connection stays open in the proxy"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn latency_delays_each_direction_without_serialising_chunks() {
    let proxy = FaultProxy::start(echo().await).await.unwrap();
    let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
    assert_eq!(round_trip(&mut s, b"warm").await, b"warm");
    proxy.set_latency(Duration::from_millis(200));
    let t0 = Instant::now();
    assert_eq!(round_trip(&mut s, b"ping").await, b"ping");
    let rtt = t0.elapsed();
    assert!(
        rtt >= Duration::from_millis(400) && rtt < Duration::from_millis(1000),
        "round trip {rtt:?} with 200 ms each way"
    );
    // 20 writes 20 ms apart: each is late by the latency, not by the ones before it.
    let t0 = Instant::now();
    let (mut r, mut w) = s.split();
    let send = async {
        for i in 0..20u8 {
            w.write_all(&[i]).await.unwrap();
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let mut back = [0u8; 20];
    let receive = async { r.read_exact(&mut back).await.unwrap() };
    tokio::join!(send, receive);
    let all = t0.elapsed();
    assert_eq!(back.to_vec(), (0..20).collect::<Vec<u8>>());
    assert!(
        all >= Duration::from_millis(780) && all < Duration::from_millis(1600),
        "20 writes over 0.4 s with a 0.4 s round trip took {all:?}"
    );
    proxy.set_latency(Duration::ZERO);
    let t0 = Instant::now();
    round_trip(&mut s, b"fast").await;
    assert!(t0.elapsed() < Duration::from_millis(100));
}

#[tokio::test]
async fn a_stall_holds_every_byte_until_resumed_then_delivers_in_order() {
    let proxy = FaultProxy::start(echo().await).await.unwrap();
    let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
    round_trip(&mut s, b"warm").await;
    proxy.stall();
    s.write_all(b"held").await.unwrap();
    let mut buf = [0u8; 4];
    let early = tokio::time::timeout(Duration::from_millis(700), s.read_exact(&mut buf)).await;
    assert!(early.is_err(), "bytes moved through a stalled proxy");
    // A connection opened while stalled is accepted and stalled too.
    let mut late = TcpStream::connect(proxy.addr()).await.unwrap();
    late.write_all(b"new!").await.unwrap();
    let mut late_buf = [0u8; 4];
    assert!(
        tokio::time::timeout(Duration::from_millis(300), late.read_exact(&mut late_buf))
            .await
            .is_err()
    );
    let resumed = Instant::now();
    proxy.resume();
    s.read_exact(&mut buf).await.unwrap();
    late.read_exact(&mut late_buf).await.unwrap();
    assert_eq!((&buf, &late_buf), (b"held", b"new!"));
    assert!(resumed.elapsed() < Duration::from_millis(200));
}

#[tokio::test]
async fn stalled_answers_let_requests_through_and_hold_the_replies() {
    // An upstream that reports what reached it, then echoes it.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = listener.local_addr().unwrap();
    let (arrived_tx, mut arrived) = tokio::sync::mpsc::unbounded_channel::<Vec<u8>>();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let arrived_tx = arrived_tx.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 4];
                while s.read_exact(&mut buf).await.is_ok() {
                    let _ = arrived_tx.send(buf.to_vec());
                    if s.write_all(&buf).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    let proxy = FaultProxy::start(upstream).await.unwrap();
    let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
    assert_eq!(round_trip(&mut s, b"warm").await, b"warm");
    assert_eq!(arrived.recv().await.unwrap(), b"warm");

    proxy.stall_answers();
    s.write_all(b"sent").await.unwrap();
    let reached = tokio::time::timeout(Duration::from_secs(2), arrived.recv()).await;
    assert_eq!(
        reached
            .expect("the request did not reach the upstream")
            .unwrap(),
        b"sent"
    );
    let mut buf = [0u8; 4];
    let early = tokio::time::timeout(Duration::from_millis(700), s.read_exact(&mut buf)).await;
    assert!(early.is_err(), "an answer moved while answers were stalled");
    proxy.resume();
    s.read_exact(&mut buf).await.unwrap();
    assert_eq!(&buf, b"sent");
}

#[tokio::test]
async fn a_cut_resets_open_connections_and_serves_new_ones() {
    let proxy = FaultProxy::start(echo().await).await.unwrap();
    let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
    round_trip(&mut s, b"warm").await;
    proxy.cut();
    let mut buf = [0u8; 1];
    let read = tokio::time::timeout(Duration::from_secs(2), s.read(&mut buf))
        .await
        .expect("a cut connection is closed at once");
    match read {
        Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset),
        Ok(n) => panic!("read {n} bytes from a cut connection, expected a reset"),
    }
    let mut again = TcpStream::connect(proxy.addr()).await.unwrap();
    assert_eq!(round_trip(&mut again, b"next").await, b"next");
}

#[tokio::test]
async fn only_loopback_addresses_are_proxied() {
    let err = FaultProxy::start("10.1.2.3:9092".parse().unwrap())
        .await
        .err()
        .expect("a non-loopback upstream is refused");
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
    assert!(err.to_string().contains("10.1.2.3:9092"), "{err}");
}

/// It may listen on a private address (the test bridge's end), never on a public one
/// or on every address; the upstream stays loopback-only whatever it listens on.
#[tokio::test]
async fn it_listens_on_loopback_or_a_private_address_only() {
    let upstream = echo().await;
    for listen in ["8.8.8.8:0", "0.0.0.0:0", "[::]:0", "[2001:db8::1]:0"] {
        let err = FaultProxy::start_on(listen.parse().unwrap(), upstream)
            .await
            .err()
            .unwrap_or_else(|| panic!("listening on {listen} is refused"));
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput, "{listen}");
        assert!(err.to_string().contains("listen address"), "{err}");
    }
    // A private listen address with a non-loopback upstream: refused for the upstream.
    let err = FaultProxy::start_on(
        "10.77.0.1:0".parse().unwrap(),
        "10.77.0.11:5672".parse().unwrap(),
    )
    .await
    .err()
    .expect("a private upstream is refused");
    assert!(
        err.to_string().contains("upstream address 10.77.0.11:5672"),
        "{err}"
    );
    // Loopback listen works and forwards.
    let proxy = FaultProxy::start_on("127.0.0.1:0".parse().unwrap(), upstream)
        .await
        .unwrap();
    let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
    assert_eq!(round_trip(&mut s, b"ping").await, b"ping");
}

#[tokio::test]
async fn a_refused_upstream_closes_the_client() {
    // A port nothing listens on: bind, note it, close.
    let dead = TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap()
        .local_addr()
        .unwrap();
    let proxy = FaultProxy::start(dead).await.unwrap();
    let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
    let mut buf = [0u8; 1];
    let read = tokio::time::timeout(Duration::from_secs(2), s.read(&mut buf))
        .await
        .expect("closed at once");
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
}

/// 20 % of the packets to and from the proxy's port dropped by the kernel: TCP
/// retransmits, the bytes arrive unchanged, and the counters show the loss.
#[tokio::test]
async fn a_lossy_link_drops_packets_and_tcp_still_delivers_every_byte() {
    let proxy = FaultProxy::start(echo().await).await.unwrap();
    let loss = crate::packet_loss::PacketLoss::start(&[proxy.addr().port()], 20).unwrap();
    let mut s = TcpStream::connect(proxy.addr()).await.unwrap();
    let mut rng = fastrand::Rng::with_seed(11);
    // Small writes, one round trip each: many packets, so the share dropped is near 20 %.
    let started = Instant::now();
    const ROUNDS: usize = 80;
    for _ in 0..ROUNDS {
        let chunk: Vec<u8> = (0..512).map(|_| rng.u8(..)).collect();
        let back = tokio::time::timeout(Duration::from_secs(30), round_trip(&mut s, &chunk))
            .await
            .expect("a round trip through the lossy link took more than 30 s");
        assert!(back == chunk, "a chunk came back changed");
    }
    let counts = loss.stop().unwrap();
    // Each round trip is at least a packet each way (the answer carries the ack).
    assert!(
        counts.seen >= 2 * ROUNDS as u64,
        "{counts:?}: too few packets"
    );
    let share = counts.dropped as f64 / counts.seen as f64;
    assert!(
        (0.1..=0.3).contains(&share),
        "{counts:?}: dropped {share:.2}, not about 0.2"
    );
    // Retransmission timeouts (≥ 200 ms each on loopback) make the link slow.
    assert!(
        started.elapsed() > Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(proxy.bytes_moved(), 2 * ROUNDS as u64 * 512);
}

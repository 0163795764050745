//! Shared by the fuzz targets: frames built from structured fuzz input (valid shapes the
//! mutator then breaks: truncation, flipped bytes, odd header lengths, extension chains,
//! fragments), and the seeded policies they run against.

use arbitrary::Arbitrary;
use peerwall_policy::testgen::{self, IFACES};

/// An IPv6 extension header to put in the chain.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Ext {
    HopByHop(u8),
    Routing(u8),
    DestOpts(u8),
    Fragment { offset: u16, more: bool },
    Ah(u8),
}

/// The transport header.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum L4 {
    Tcp {
        flags: u8,
    },
    Udp,
    /// SCTP's common header and the first chunk's header.
    Sctp {
        chunk: u8,
    },
    Icmp {
        kind: u8,
        code: u8,
    },
    Other(u8),
}

/// A header field overwritten after the frame is built (the flow's later packet damaged in
/// the fields a cached verdict must not be served past).
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum Damage {
    /// IPv4 total length / IPv6 payload length (see [`odd_len`]).
    Length(u16),
    /// IPv4 header length (low nibble of the first byte).
    Ihl(u8),
    /// IP version (high nibble of the first byte).
    Version(u8),
    /// IPv4 flags and fragment offset.
    Fragment(u16),
    /// IPv4 protocol / IPv6 next header.
    Protocol(u8),
    /// TCP flags (the transport header's 14th byte, whatever the protocol).
    TcpFlags(u8),
}

/// A frame as fuzz input: a well-formed shape, then the damage done to it.
#[derive(Arbitrary, Debug)]
pub struct FrameInput {
    pub policy: u8,
    pub iif: u8,
    /// `oif % 4 == 3`: no output interface (a packet to the gateway itself).
    pub oif: u8,
    pub six: bool,
    pub src: u8,
    pub dst: u8,
    pub sport: u8,
    pub dport: u8,
    pub l4: L4,
    pub ext: Vec<Ext>,
    /// IPv4 flags and fragment offset field.
    pub v4_frag: u16,
    /// IPv4 header length in words, when not 5.
    pub v4_ihl: Option<u8>,
    /// IP total / payload length, when not the real one: below 0x8000, a length from 0 to 63
    /// (around the headers' own sizes, where the checks are); above, any.
    pub ip_len: Option<u16>,
    /// Another EtherType.
    pub ethertype: Option<u16>,
    /// A header field the datapath's known-flow path reads by hand, overwritten.
    pub damage: Option<Damage>,
    /// Cut the frame to this many bytes (at least the Ethernet header).
    pub truncate: Option<u16>,
    /// Bytes XORed into the frame.
    pub flips: Vec<(u16, u8)>,
}

/// Addresses the seeded policies use (testgen's pools), so rules hit.
fn addr(six: bool, i: u8) -> Vec<u8> {
    let (hi, lo) = (i % 2, (i / 2) % 15 + 1);
    if six {
        vec![0xfd, hi, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, lo]
    } else {
        vec![10, hi, 0, lo]
    }
}

/// Ethernet header length.
const ETH: usize = 14;

/// The length field [`FrameInput::ip_len`] asks for.
fn odd_len(v: u16) -> u16 {
    if v < 0x8000 {
        v % 64
    } else {
        v
    }
}

const PORTS: [u16; 8] = [40000, 80, 1024, 79, 81, 443, 22, 5000];

impl FrameInput {
    /// Input and output interface names.
    pub fn ifaces(&self) -> (&'static str, Option<&'static str>) {
        let iif = IFACES[usize::from(self.iif) % IFACES.len()];
        let oif = (self.oif % 4 != 3).then(|| IFACES[usize::from(self.oif % 4) % IFACES.len()]);
        (iif, oif)
    }

    /// [`frame`](Self::frame) before the damage (bytes flipped, cut short): the packet a
    /// flow's first one may have been.
    pub fn undamaged(&self) -> Vec<u8> {
        FrameInput {
            flips: Vec::new(),
            damage: None,
            truncate: None,
            l4: self.l4,
            ext: self.ext.clone(),
            ..*self
        }
        .frame()
    }

    /// The frame: Ethernet, IP (extension headers for IPv6), transport header, 8 bytes of
    /// payload; then the damage.
    pub fn frame(&self) -> Vec<u8> {
        let proto_of = |l4: L4| match l4 {
            L4::Tcp { .. } => 6,
            L4::Udp => 17,
            L4::Sctp { .. } => 132,
            L4::Icmp { .. } => {
                if self.six {
                    58
                } else {
                    1
                }
            }
            L4::Other(p) => p,
        };
        let sport = PORTS[usize::from(self.sport) % PORTS.len()];
        let dport = PORTS[usize::from(self.dport) % PORTS.len()];
        let mut l4 = match self.l4 {
            L4::Tcp { flags } => {
                let mut t = vec![0u8; 20];
                t[0..2].copy_from_slice(&sport.to_be_bytes());
                t[2..4].copy_from_slice(&dport.to_be_bytes());
                t[12] = 0x50;
                t[13] = flags;
                t
            }
            L4::Udp => {
                let mut u = vec![0u8; 8];
                u[0..2].copy_from_slice(&sport.to_be_bytes());
                u[2..4].copy_from_slice(&dport.to_be_bytes());
                u[4..6].copy_from_slice(&16u16.to_be_bytes());
                u
            }
            L4::Sctp { chunk } => {
                let mut h = vec![0u8; 16];
                h[0..2].copy_from_slice(&sport.to_be_bytes());
                h[2..4].copy_from_slice(&dport.to_be_bytes());
                h[12] = chunk % 16;
                h[15] = 4;
                h
            }
            L4::Icmp { kind, code } => vec![kind, code, 0, 0, 0x12, 0x34, 0, 1],
            L4::Other(_) => vec![0u8; 8],
        };
        l4.extend_from_slice(&[0xab; 8]);
        let mut ip = Vec::new();
        let proto = proto_of(self.l4);
        if self.six {
            let mut ext = Vec::new();
            let chain: Vec<Ext> = self.ext.iter().take(8).copied().collect();
            let kind = |e: &Ext| match e {
                Ext::HopByHop(_) => 0u8,
                Ext::Routing(_) => 43,
                Ext::DestOpts(_) => 60,
                Ext::Fragment { .. } => 44,
                Ext::Ah(_) => 51,
            };
            for (i, e) in chain.iter().enumerate() {
                let next = chain.get(i + 1).map_or(proto, kind);
                match *e {
                    Ext::HopByHop(n) | Ext::Routing(n) | Ext::DestOpts(n) => {
                        let n = n % 4;
                        let mut h = vec![0u8; (usize::from(n) + 1) * 8];
                        h[0] = next;
                        h[1] = n;
                        ext.extend_from_slice(&h);
                    }
                    Ext::Ah(n) => {
                        let n = n % 4 + 1;
                        let mut h = vec![0u8; (usize::from(n) + 2) * 4];
                        h[0] = next;
                        h[1] = n;
                        ext.extend_from_slice(&h);
                    }
                    Ext::Fragment { offset, more } => {
                        let f = (offset << 3) | u16::from(more);
                        let mut h = vec![next, 0, 0, 0, 0, 0, 0, 1];
                        h[2..4].copy_from_slice(&f.to_be_bytes());
                        ext.extend_from_slice(&h);
                    }
                }
            }
            let first = chain.first().map_or(proto, kind);
            let plen = self.ip_len.map_or((ext.len() + l4.len()) as u16, odd_len);
            ip.extend_from_slice(&[0x60, 0, 0, 0]);
            ip.extend_from_slice(&plen.to_be_bytes());
            ip.extend_from_slice(&[first, 64]);
            ip.extend_from_slice(&addr(true, self.src));
            ip.extend_from_slice(&addr(true, self.dst));
            ip.extend_from_slice(&ext);
        } else {
            let ihl = self.v4_ihl.map_or(5, |v| v % 16);
            let opts = usize::from(ihl.saturating_sub(5)) * 4;
            let tot = self.ip_len.map_or((20 + opts + l4.len()) as u16, odd_len);
            ip.extend_from_slice(&[0x40 | ihl, 0]);
            ip.extend_from_slice(&tot.to_be_bytes());
            ip.extend_from_slice(&[0, 1]);
            ip.extend_from_slice(&self.v4_frag.to_be_bytes());
            ip.extend_from_slice(&[64, proto, 0, 0]);
            ip.extend_from_slice(&addr(false, self.src));
            ip.extend_from_slice(&addr(false, self.dst));
            ip.extend_from_slice(&vec![1u8; opts]);
        }
        let l4_at = ETH + ip.len();
        ip.extend_from_slice(&l4);
        let et = self
            .ethertype
            .unwrap_or(if self.six { 0x86dd } else { 0x0800 });
        let mut f = vec![2, 0, 0, 0, 0, 2, 2, 0, 0, 0, 0, 1];
        f.extend_from_slice(&et.to_be_bytes());
        f.extend_from_slice(&ip);
        for &(at, x) in self.flips.iter().take(4) {
            let n = f.len();
            f[usize::from(at) % n] ^= x;
        }
        let vihl = f.get(ETH).copied().unwrap_or(0);
        let mut put = |at: usize, bytes: &[u8]| {
            if let Some(d) = f.get_mut(at..at + bytes.len()) {
                d.copy_from_slice(bytes);
            }
        };
        match (self.damage, self.six) {
            (None, _) => {}
            (Some(Damage::Length(v)), false) => put(ETH + 2, &odd_len(v).to_be_bytes()),
            (Some(Damage::Length(v)), true) => put(ETH + 4, &odd_len(v).to_be_bytes()),
            (Some(Damage::Ihl(v)), _) => put(ETH, &[(vihl & 0xf0) | (v & 0x0f)]),
            (Some(Damage::Version(v)), _) => put(ETH, &[(vihl & 0x0f) | (v << 4)]),
            (Some(Damage::Fragment(v)), false) => put(ETH + 6, &v.to_be_bytes()),
            (Some(Damage::Fragment(_)), true) => {}
            (Some(Damage::Protocol(v)), false) => put(ETH + 9, &[v]),
            (Some(Damage::Protocol(v)), true) => put(ETH + 6, &[v]),
            (Some(Damage::TcpFlags(v)), _) => put(l4_at + 13, &[v]),
        }
        if let Some(t) = self.truncate {
            f.truncate(usize::from(t).max(14));
        }
        f
    }
}

/// The seeded random policies the datapath target runs (testgen, like the differential
/// tests): `n` of them, the ones the bpf datapath takes.
pub fn policies(n: usize) -> Vec<peerwall_policy::ir::Policy> {
    use rand::SeedableRng;
    let mut out = Vec::new();
    let mut seed = 0u64;
    while out.len() < n && seed < 1000 {
        let mut rng = rand::rngs::StdRng::seed_from_u64(0xf022 + seed);
        seed += 1;
        let specs = testgen::random_specs(&mut rng);
        if let Ok(c) = peerwall_policy::compile::compile(&testgen::objects(&specs)) {
            out.push(c.policy);
        }
    }
    out
}

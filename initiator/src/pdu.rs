//! PDUs on a byte stream: a cancel-safe reader and a writer around the
//! framing in `ramslog_common::iscsi::frame`.

use bytes::BytesMut;
use ramslog_common::iscsi::frame::{self, DeframeError, Deframed, RxRules};
use ramslog_common::iscsi::{Bhs, Opcode, WireError, BHS_LEN};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::Error;

/// One PDU as received: the AHS area (without header digest) and the data
/// segment (without padding or data digest).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pdu {
    pub bhs: Bhs,
    pub ahs: Vec<u8>,
    pub data: Vec<u8>,
}

impl Pdu {
    pub fn opcode(&self) -> Option<Opcode> {
        self.bhs.opcode()
    }
}

pub use ramslog_common::iscsi::frame::Digests;

/// Append one PDU to `out`, as [`frame::encode`] does.
fn encode_pdu(
    bhs: &Bhs,
    ahs: &[u8],
    data: &[u8],
    digests: Digests,
    out: &mut Vec<u8>,
) -> Result<(), Error> {
    frame::encode(bhs, ahs, data, digests, out).map_err(|e| Error::InvalidArgument(e.to_string()))
}

/// Reads PDUs from a byte stream. `read_pdu` is cancel-safe: bytes of a
/// partially received PDU stay buffered for the next call.
pub struct PduReader<R> {
    rd: R,
    buf: BytesMut,
    pub(crate) digests: Digests,
    /// Largest data segment accepted (our MaxRecvDataSegmentLength).
    pub(crate) max_data_len: u32,
}

/// During login both sides' MaxRecvDataSegmentLength is 8192 (RFC 7143 13.12).
pub const LOGIN_MAX_DATA: u32 = 8192;

impl<R: AsyncRead + Unpin> PduReader<R> {
    pub fn new(rd: R) -> Self {
        PduReader {
            rd,
            buf: BytesMut::with_capacity(64 * 1024),
            digests: Digests::default(),
            max_data_len: LOGIN_MAX_DATA,
        }
    }

    pub async fn read_pdu(&mut self) -> Result<Pdu, Error> {
        loop {
            if let Some(p) = self.try_parse()? {
                return Ok(p);
            }
            if self.buf.capacity() - self.buf.len() < 16 * 1024 {
                self.buf.reserve(64 * 1024);
            }
            let n = self.rd.read_buf(&mut self.buf).await?;
            if n == 0 {
                return Err(if self.buf.is_empty() {
                    Error::Closed
                } else {
                    Error::proto(format!(
                        "connection closed in the middle of a PDU ({} bytes buffered)",
                        self.buf.len()
                    ))
                });
            }
        }
    }

    fn try_parse(&mut self) -> Result<Option<Pdu>, Error> {
        // An unknown opcode is a protocol error as soon as its header is in.
        if let Some(header) = self.buf.get(..BHS_LEN) {
            Bhs::decode(header).map_err(wire)?;
        }
        let rules = RxRules {
            digests: self.digests,
            max_data_len: self.max_data_len,
        };
        let (pdu, data_digest_ok, wire_len) = match frame::deframe(&self.buf, rules) {
            Ok(Deframed::Pdu(f)) => (
                Pdu {
                    bhs: f.bhs,
                    ahs: f.ahs.to_vec(),
                    data: f.data.to_vec(),
                },
                f.data_digest_ok,
                f.wire_len,
            ),
            Ok(Deframed::Incomplete { need }) => {
                self.buf.reserve(need.saturating_sub(self.buf.len()));
                return Ok(None);
            }
            Err(DeframeError::HeaderDigest) => return Err(Error::Digest { header: true }),
            Err(DeframeError::Oversized { bhs, len, limit }) => {
                return Err(Error::proto(format!(
                    "data segment of {len} bytes exceeds our MaxRecvDataSegmentLength {limit} (opcode {:#04x})",
                    bhs.raw_opcode()
                )))
            }
        };
        let _ = self.buf.split_to(wire_len);
        if self.buf.is_empty() && self.buf.capacity() > 4 * 1024 * 1024 {
            self.buf = BytesMut::with_capacity(64 * 1024);
        }
        if !data_digest_ok {
            return Err(Error::Digest { header: false });
        }
        Ok(Some(pdu))
    }
}

fn wire(e: WireError) -> Error {
    Error::proto(e.to_string())
}

/// Writes PDUs to a byte stream.
pub struct PduWriter<W> {
    wr: W,
    buf: Vec<u8>,
    pub(crate) digests: Digests,
}

impl<W: AsyncWrite + Unpin> PduWriter<W> {
    pub fn new(wr: W) -> Self {
        PduWriter {
            wr,
            buf: Vec::with_capacity(64 * 1024),
            digests: Digests::default(),
        }
    }

    pub async fn write_pdu(&mut self, bhs: &Bhs, ahs: &[u8], data: &[u8]) -> Result<(), Error> {
        self.buf.clear();
        encode_pdu(bhs, ahs, data, self.digests, &mut self.buf)?;
        self.wr.write_all(&self.buf).await?;
        if self.buf.capacity() > 4 * 1024 * 1024 {
            self.buf = Vec::with_capacity(64 * 1024);
        }
        Ok(())
    }

    pub async fn write_raw(&mut self, bytes: &[u8]) -> Result<(), Error> {
        self.wr.write_all(bytes).await?;
        Ok(())
    }

    pub async fn shutdown(&mut self) -> Result<(), Error> {
        self.wr.shutdown().await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn round_trip(digests: Digests, ahs: &[u8], data: &[u8]) -> Pdu {
        let mut bhs = Bhs::new(Opcode::DataIn);
        bhs.set_itt(0x1234);
        let mut wire_bytes = Vec::new();
        encode_pdu(&bhs, ahs, data, digests, &mut wire_bytes).unwrap();
        // Feed the bytes in awkward pieces.
        let (mut a, b) = tokio::io::duplex(7);
        let mut r = PduReader::new(b);
        r.digests = digests;
        r.max_data_len = 1 << 20;
        let w = tokio::spawn(async move {
            a.write_all(&wire_bytes).await.unwrap();
            a
        });
        let p = r.read_pdu().await.unwrap();
        drop(w.await.unwrap());
        assert!(matches!(r.read_pdu().await, Err(Error::Closed)));
        p
    }

    #[tokio::test]
    async fn framing_round_trips() {
        for digests in [
            Digests::default(),
            Digests {
                header: true,
                data: true,
            },
        ] {
            let p = round_trip(digests, &[0, 1, 2, 3, 4], b"hello").await;
            assert_eq!(p.bhs.itt(), 0x1234);
            assert_eq!(p.bhs.data_segment_len(), 5);
            assert_eq!(p.bhs.total_ahs_len(), 8);
            assert_eq!(p.ahs, vec![0, 1, 2, 3, 4, 0, 0, 0]);
            assert_eq!(p.data, b"hello");
            let p = round_trip(digests, &[], &[]).await;
            assert!(p.data.is_empty());
        }
    }

    #[tokio::test]
    async fn bad_digest_and_limits() {
        let bhs = Bhs::new(Opcode::NopIn);
        let d = Digests {
            header: true,
            data: true,
        };
        let mut bytes = Vec::new();
        encode_pdu(&bhs, &[], b"ping", d, &mut bytes).unwrap();
        let n = bytes.len();
        bytes[n - 5] ^= 1; // flip a data byte
        let mut r = PduReader::new(&bytes[..]);
        r.digests = d;
        assert!(matches!(
            r.read_pdu().await,
            Err(Error::Digest { header: false })
        ));
        bytes[3] ^= 1; // header damaged
        let mut r = PduReader::new(&bytes[..]);
        r.digests = d;
        assert!(matches!(
            r.read_pdu().await,
            Err(Error::Digest { header: true })
        ));

        let mut big = Bhs::new(Opcode::DataIn);
        big.set_data_segment_len(9000);
        let mut r = PduReader::new(&big.as_bytes()[..]);
        assert!(matches!(r.read_pdu().await, Err(Error::Protocol(_))));

        let mut r = PduReader::new(&bytes[..20]);
        assert!(matches!(r.read_pdu().await, Err(Error::Protocol(_))));
    }
}

//! PDU framing on a byte stream: encoding with padding and digests, and a
//! cancel-safe reader that verifies digests and limits.

use bytes::BytesMut;
use ramslog_common::iscsi::{
    digest, padded, Bhs, Opcode, PduLayout, WireError, BHS_LEN, MAX_DATA_SEGMENT_LEN,
};
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

/// Which digests are in force (both off during login).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Digests {
    pub header: bool,
    pub data: bool,
}

/// Append one PDU to `out`. TotalAHSLength and DataSegmentLength in the BHS are
/// set from `ahs` (zero-padded to 4 bytes) and `data`; the data segment is
/// padded and the digests computed as `digests` says.
pub fn encode_pdu(
    bhs: &Bhs,
    ahs: &[u8],
    data: &[u8],
    digests: Digests,
    out: &mut Vec<u8>,
) -> Result<(), Error> {
    if data.len() > MAX_DATA_SEGMENT_LEN as usize {
        return Err(Error::InvalidArgument(format!(
            "data segment of {} bytes does not fit 24 bits",
            data.len()
        )));
    }
    let ahs_padded = padded(ahs.len());
    let mut b = *bhs;
    b.set_total_ahs_len(ahs_padded)
        .map_err(|_| Error::InvalidArgument("AHS longer than 1020 bytes".into()))?
        .set_data_segment_len(data.len() as u32);
    let start = out.len();
    out.extend_from_slice(b.as_bytes());
    out.extend_from_slice(ahs);
    out.resize(start + BHS_LEN + ahs_padded, 0);
    if digests.header {
        let d = digest::header(&out[start..start + BHS_LEN], &out[start + BHS_LEN..]);
        out.extend_from_slice(&digest::to_wire(d));
    }
    if !data.is_empty() {
        out.extend_from_slice(data);
        out.resize(out.len() + padded(data.len()) - data.len(), 0);
        if digests.data {
            out.extend_from_slice(&digest::to_wire(digest::data(data)));
        }
    }
    Ok(())
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
        if self.buf.len() < BHS_LEN {
            return Ok(None);
        }
        let bhs = Bhs::decode(&self.buf[..BHS_LEN]).map_err(wire)?;
        let layout = PduLayout::of(&bhs, self.digests.header, self.digests.data);
        if layout.data_len > self.max_data_len as usize {
            return Err(Error::proto(format!(
                "data segment of {} bytes exceeds our MaxRecvDataSegmentLength {} (opcode {:#04x})",
                layout.data_len,
                self.max_data_len,
                bhs.raw_opcode()
            )));
        }
        let total = BHS_LEN + layout.header_rest() + layout.data_wire_len();
        if self.buf.len() < total {
            self.buf.reserve(total - self.buf.len());
            return Ok(None);
        }
        let frame = self.buf.split_to(total);
        let ahs_end = BHS_LEN + layout.ahs_len;
        let mut off = ahs_end;
        if layout.header_digest {
            let got = digest::from_wire(read4(&frame, off));
            if got != digest::header(&frame[..BHS_LEN], &frame[BHS_LEN..ahs_end]) {
                return Err(Error::Digest { header: true });
            }
            off += 4;
        }
        let data_start = off;
        let mut data = Vec::new();
        if layout.data_len > 0 {
            let pad_end = data_start + padded(layout.data_len);
            if layout.data_digest {
                let got = digest::from_wire(read4(&frame, pad_end));
                // The digest covers the padding as sent (digest::data of an
                // already padded slice adds nothing).
                if got != digest::data(&frame[data_start..pad_end]) {
                    return Err(Error::Digest { header: false });
                }
            }
            data = frame[data_start..data_start + layout.data_len].to_vec();
        }
        let ahs = frame[BHS_LEN..ahs_end].to_vec();
        drop(frame);
        if self.buf.is_empty() && self.buf.capacity() > 4 * 1024 * 1024 {
            self.buf = BytesMut::with_capacity(64 * 1024);
        }
        Ok(Some(Pdu { bhs, ahs, data }))
    }
}

fn read4(b: &[u8], off: usize) -> [u8; 4] {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[off..off + 4]);
    a
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

//! The codec of the generated servers (`build.rs` names it): prost's
//! encoding, into a response buffer that takes no memory until there is
//! something to send.

use bytes::BufMut;

/// How much an encode buffer takes at a time once it has something to
/// encode: tonic's default buffer size, so that a busy subscription encodes
/// many deliveries into one allocation.
pub const ENCODE_CHUNK: usize = 8 * 1024;

/// What a request's decode buffer holds before its first frame (tonic's
/// default is 8 KiB). The buffer grows to the largest frame the stream
/// has carried and keeps that, so a busy publisher reallocates a few times
/// at its start and never again; an idle `Session` stream holds what its
/// opens took, not 8 KiB (issue 47: 82 bytes of each idle subscription at
/// 100 a session).
pub const DECODE_START: usize = 512;

/// tonic's default: a stream hands h2 what it has encoded once this much is
/// buffered, rather than encoding everything that is ready first.
const YIELD_THRESHOLD: usize = 32 * 1024;

/// The codec of the generated servers (`build.rs`): prost's encoding, with
/// an encode buffer that takes no memory until the response has something
/// to send. tonic reserves a response's buffer (8 KiB by default) when the
/// response is made; when subscription streams went through it, every idle
/// subscription held 8 KiB it never used (issue 16: 7.1 KiB per idle
/// subscription, BENCHMARKS.md). Subscriptions have their own body now
/// (`grpc::SubscriptionBody`); the other responses still start empty, and
/// [`ServerEncoder`] reserves [`ENCODE_CHUNK`] when a message does not fit
/// what is left. Decoding is prost's own, into a buffer that starts at
/// [`DECODE_START`].
#[derive(Debug)]
pub struct ServerCodec<T, U>(std::marker::PhantomData<(T, U)>);

impl<T, U> Default for ServerCodec<T, U> {
    fn default() -> Self {
        Self(std::marker::PhantomData)
    }
}

impl<T, U> tonic::codec::Codec for ServerCodec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ServerEncoder<T>;
    type Decoder = tonic_prost::ProstDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ServerEncoder(std::marker::PhantomData)
    }

    fn decoder(&mut self) -> Self::Decoder {
        tonic_prost::ProstDecoder::new(tonic::codec::BufferSettings::new(DECODE_START, YIELD_THRESHOLD))
    }
}

/// prost's encoding into a buffer reserved a chunk at a time (see
/// [`ServerCodec`]).
#[derive(Debug)]
pub struct ServerEncoder<T>(std::marker::PhantomData<T>);

impl<T: prost::Message> tonic::codec::Encoder for ServerEncoder<T> {
    type Item = T;
    type Error = tonic::Status;

    #[inline]
    fn encode(&mut self, item: T, buf: &mut tonic::codec::EncodeBuf<'_>) -> Result<(), tonic::Status> {
        let len = item.encoded_len();
        // What is left of the current allocation (`chunk_mut` makes room
        // for a few bytes when there is none).
        if buf.chunk_mut().len() < len {
            buf.reserve(len.max(ENCODE_CHUNK));
        }
        // `encode` would compute the length again to check the room made
        // just above: a second `encoded_len` per delivery.
        item.encode_raw(buf);
        Ok(())
    }

    fn buffer_settings(&self) -> tonic::codec::BufferSettings {
        // Next to nothing reserved up front: the first message reserves a
        // chunk. (1, not 0: tonic divides by it when it compresses.)
        tonic::codec::BufferSettings::new(1, YIELD_THRESHOLD)
    }
}

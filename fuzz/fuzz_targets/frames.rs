//! Every decoder of bytes from the network, on arbitrary bytes: an error is fine, a panic or an
//! allocation sized by a claimed length is not.
#![no_main]

use bytes::Bytes;
use flotilla::actors::stage::StageOutcome;
use flotilla::net::{ControlMessage, Frame};
use flotilla::ps::wire::{decode_reply, decode_request};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let body = Bytes::copy_from_slice(data);
    let _ = Frame::<ControlMessage>::decode(body.clone());
    let _ = decode_request(body.clone());
    let _ = decode_reply(body.clone());
    let _ = StageOutcome::from_bytes(body);
});

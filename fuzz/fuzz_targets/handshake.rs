//! Both sides of the cluster-token handshake against a peer that sends arbitrary bytes: each
//! must refuse (or, for the impossible guess of a valid MAC, accept) without panicking.
#![no_main]

use std::io::{Read, Write};

use flotilla::net::auth::{accept_on, connect_on, ClusterToken, Credentials};
use libfuzzer_sys::fuzz_target;

/// A peer that answers with the fuzzer's bytes and swallows what it is sent.
struct Scripted<'a> {
    input: &'a [u8],
}

impl Read for Scripted<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.input.read(buf)
    }
}

impl Write for Scripted<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fuzz_target!(|data: &[u8]| {
    let token = ClusterToken::new("the fuzzing cluster's token").expect("token");
    let credentials = Credentials::new(token, std::time::Duration::from_secs(1));
    assert!(accept_on(&mut Scripted { input: data }, &credentials).is_err() || data.len() >= 72);
    assert!(connect_on(&mut Scripted { input: data }, &credentials).is_err() || data.len() >= 64);
});

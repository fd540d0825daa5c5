//! A small Hyperlight guest: the code that runs inside the micro-VM.
//!
//! There is no operating system in the VM, so this is a `no_std`, `no_main` binary: the
//! `hyperlight-guest-bin` crate supplies the entry point (`entrypoint`), the heap allocator and the
//! panic handler, and dispatches the host's calls to the functions registered below.
#![no_std]
#![no_main]

extern crate alloc;

use alloc::string::String;

use hyperlight_guest::error::HyperlightGuestError;
use hyperlight_guest_bin::{guest_function, host_function};

// A host function: the body lives in the host program (it registers "HostAdd"); this declaration
// generates the call across the VM boundary. Returning a `Result` hands a host-side failure back to
// the caller as an error instead of panicking inside the guest.
#[host_function("HostAdd")]
fn host_add(a: i32, b: i32) -> Result<i32, HyperlightGuestError>;

// Guest functions: the host calls them by the name given here. Arguments and results travel as
// flatbuffers, so only Hyperlight's parameter types (integers, floats, bool, String, Vec<u8>) fit.

/// The smallest round trip: two integers in, one out.
#[guest_function("Add")]
fn add(a: i32, b: i32) -> i32 {
    // Wrapping: an overflow must not panic (a panic aborts the guest call).
    a.wrapping_add(b)
}

/// A string in and the same string out: shows heap use and string marshalling both ways.
#[guest_function("Echo")]
fn echo(message: String) -> String {
    message
}

/// Calls back into the host and returns what the host answered: a guest can only reach the
/// outside world through host functions that the host chose to register.
#[guest_function("CallHost")]
fn call_host(a: i32, b: i32) -> Result<i32, HyperlightGuestError> {
    host_add(a, b)
}

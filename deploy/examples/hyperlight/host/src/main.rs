//! The host side of the Hyperlight example: loads the guest ELF into a micro-VM on /dev/kvm,
//! registers one host function the guest may call, and calls the guest's functions.
//!
//! Usage: hyperlight-example [--guest PATH] [--json] [--runs N]
//!
//! Exit status: 0 when every answer was right, 1 when Hyperlight (or the guest) failed, 2 for a
//! bad command line. Failures are one line on stderr, `hyperlight-example: <error>`, with
//! Hyperlight's own error text, so a pod's log says why (no hypervisor, no permission, ...).

use std::process::ExitCode;
use std::time::{Duration, Instant};

use hyperlight_host::{Sandbox, SandboxBuilder, is_hypervisor_present};
use serde::Serialize;

const NAME: &str = "hyperlight-example";
const USAGE: &str = "usage: hyperlight-example [--guest PATH] [--json] [--runs N]";
/// Where the example's image puts the guest; HYPERLIGHT_EXAMPLE_GUEST overrides it.
const DEFAULT_GUEST: &str = "/hyperlight-guest";
const ECHO_TEXT: &str = "hello from the host";
/// What the guest's CallHost passes to the host's HostAdd, and what must come back.
const HOST_CALL_ARGS: (i32, i32) = (1000, 337);

struct Options {
    guest: String,
    json: bool,
    runs: usize,
}

/// The --json line, one object; its fields in this order.
#[derive(Serialize)]
struct Report<'a> {
    hypervisor: &'a str,
    guest: &'a str,
    /// Median over the runs of building a sandbox (VM created, guest loaded and initialised).
    build_ms: f64,
    /// Median over the runs of one Add(40, 2) call, host to guest and back.
    call_us: f64,
    add: i32,
    echo: &'a str,
    host_call: i32,
    runs: usize,
}

/// What one sandbox's run measured and answered.
struct Run {
    build: Duration,
    call: Duration,
    add: i32,
    echo: String,
    host_call: i32,
}

fn main() -> ExitCode {
    // A bug here must still end as one line and status 1, not a multi-line panic report.
    std::panic::set_hook(Box::new(|info| {
        eprintln!("{NAME}: internal error: {info}");
        std::process::exit(1);
    }));
    let options = match parse_args(std::env::args().skip(1)) {
        Ok(Some(options)) => options,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(message) => {
            // One line: what was wrong, then how it is used.
            eprintln!("{NAME}: {message} ({USAGE})");
            return ExitCode::from(2);
        }
    };
    match run_all(&options) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("{NAME}: {message}");
            ExitCode::from(1)
        }
    }
}

/// `Ok(None)` means --help.
fn parse_args(mut args: impl Iterator<Item = String>) -> Result<Option<Options>, String> {
    let mut options = Options {
        guest: std::env::var("HYPERLIGHT_EXAMPLE_GUEST").unwrap_or_else(|_| DEFAULT_GUEST.into()),
        json: false,
        runs: 1,
    };
    while let Some(arg) = args.next() {
        // Accept both `--opt value` and `--opt=value`.
        let (flag, inline) = match arg.split_once('=') {
            Some((flag, value)) if flag.starts_with("--") => {
                (flag.to_string(), Some(value.to_string()))
            }
            _ => (arg.clone(), None),
        };
        let mut value = |flag: &str| {
            inline.clone().or_else(|| args.next()).ok_or_else(|| format!("{flag} needs a value"))
        };
        match flag.as_str() {
            "-h" | "--help" => return Ok(None),
            "--json" if inline.is_none() => options.json = true,
            "--guest" => {
                options.guest = value("--guest")?;
                if options.guest.is_empty() {
                    return Err("--guest: empty path".into());
                }
            }
            "--runs" => {
                let text = value("--runs")?;
                options.runs = match text.parse::<usize>() {
                    Ok(n) if n >= 1 => n,
                    _ => return Err(format!("--runs: not a positive whole number: {text:?}")),
                };
            }
            _ => return Err(format!("unknown argument: {arg:?}")),
        }
    }
    Ok(Some(options))
}

fn run_all(options: &Options) -> Result<(), String> {
    // Only KVM is compiled in (the crate's "kvm" feature), and Hyperlight opens /dev/kvm for it.
    // When it is missing we still build a sandbox below, so the error printed is Hyperlight's own.
    let hypervisor = if is_hypervisor_present() { "kvm" } else { "none" };
    if !options.json && hypervisor != "none" {
        println!("hypervisor: {hypervisor} (/dev/kvm)");
    }
    let mut runs = Vec::with_capacity(options.runs);
    for _ in 0..options.runs {
        let run = run_once(&options.guest)?;
        check(&run)?;
        if !options.json && runs.is_empty() {
            print_human(&run);
        }
        runs.push(run);
    }
    if options.json {
        let first = &runs[0];
        let report = Report {
            hypervisor,
            guest: &options.guest,
            build_ms: round(median(runs.iter().map(|r| r.build.as_secs_f64() * 1e3)), 3),
            call_us: round(median(runs.iter().map(|r| r.call.as_secs_f64() * 1e6)), 1),
            add: first.add,
            echo: &first.echo,
            host_call: first.host_call,
            runs: runs.len(),
        };
        let line = serde_json::to_string(&report).map_err(|e| e.to_string())?;
        println!("{line}");
    } else {
        if runs.len() > 1 {
            println!(
                "{} sandboxes: median build {:.1} ms, median Add round trip {:.1} µs",
                runs.len(),
                median(runs.iter().map(|r| r.build.as_secs_f64() * 1e3)),
                median(runs.iter().map(|r| r.call.as_secs_f64() * 1e6)),
            );
        }
        println!("ok");
    }
    Ok(())
}

/// Builds one sandbox (a fresh VM with the guest loaded and initialised) and calls each guest
/// function once. Errors are Hyperlight's, rendered with its own Display text.
fn run_once(guest: &str) -> Result<Run, String> {
    let started = Instant::now();
    let mut sandbox: Sandbox = SandboxBuilder::from_file(guest)
        // The only door out of the VM the guest gets: HostAdd, which the guest's CallHost uses.
        .host_function("HostAdd", |a: i32, b: i32| a.wrapping_add(b))
        .build()
        .map_err(|e| e.to_string())?;
    let build = started.elapsed();

    let started = Instant::now();
    let add: i32 = sandbox.call("Add", (40_i32, 2_i32)).map_err(|e| e.to_string())?;
    let call = started.elapsed();
    let echo: String = sandbox.call("Echo", ECHO_TEXT.to_string()).map_err(|e| e.to_string())?;
    let host_call: i32 = sandbox.call("CallHost", HOST_CALL_ARGS).map_err(|e| e.to_string())?;
    Ok(Run { build, call, add, echo, host_call })
}

/// A wrong answer is a failure too: the point is that the guest really ran.
fn check(run: &Run) -> Result<(), String> {
    let host_sum = HOST_CALL_ARGS.0 + HOST_CALL_ARGS.1;
    if run.add != 42 {
        return Err(format!("guest Add(40, 2) returned {}, expected 42", run.add));
    }
    if run.echo != ECHO_TEXT {
        return Err(format!("guest Echo returned {:?}, expected {ECHO_TEXT:?}", run.echo));
    }
    if run.host_call != host_sum {
        return Err(format!("guest CallHost returned {}, expected {host_sum}", run.host_call));
    }
    Ok(())
}

fn print_human(run: &Run) {
    let (a, b) = HOST_CALL_ARGS;
    println!("sandbox built in {:.1} ms", run.build.as_secs_f64() * 1e3);
    println!("guest Add(40, 2) = {} in {:.1} µs", run.add, run.call.as_secs_f64() * 1e6);
    println!("guest Echo({ECHO_TEXT:?}) = {:?}", run.echo);
    println!("guest CallHost({a}, {b}) = {} via host function HostAdd", run.host_call);
}

fn median(values: impl Iterator<Item = f64>) -> f64 {
    let mut values: Vec<f64> = values.collect();
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    if values.len().is_multiple_of(2) { (values[mid - 1] + values[mid]) / 2.0 } else { values[mid] }
}

fn round(value: f64, decimals: i32) -> f64 {
    let scale = 10_f64.powi(decimals);
    (value * scale).round() / scale
}

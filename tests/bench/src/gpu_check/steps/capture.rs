//! Graph capture across the token's moves: a high holder idling inside a capture, a low
//! holder revoked inside one, and a multi-stream (fork/join) capture under token churn.

use crate::gpu_check::jobs::{
    beside, churn_while, lease, probe, probe_verdict, run, start_arbiter, GIB,
};
use crate::gpu_check::{StepEnv, Verdict};
use gpushare_proto::Priority;

/// A high-priority holder sleeps inside a GLOBAL capture: the capture completes.
pub fn high_idle(env: &StepEnv) -> Verdict {
    let run_it = || -> Result<Verdict, String> {
        let arbiter = start_arbiter(env, 500)?;
        let high = lease(&arbiter, "high", Priority::High, 4 * GIB)?;
        Ok(probe_verdict(&run(&mut probe(
            env,
            Some(&high),
            &[
                "launch",
                "1",
                "capture-begin",
                "global",
                "sleep",
                "50",
                "capture-launch",
                "3",
                "sleep",
                "50",
                "capture-end",
            ],
        ))))
    };
    run_it().unwrap_or_else(Verdict::fail)
}

/// A low-priority holder is revoked (a high job launches) in the middle of a GLOBAL capture:
/// the capture completes and the job goes on.
pub fn low_revoked(env: &StepEnv) -> Verdict {
    let run_it = || -> Result<Verdict, String> {
        let arbiter = start_arbiter(env, 500)?;
        let high = lease(&arbiter, "high", Priority::High, 4 * GIB)?;
        let low = lease(&arbiter, "low", Priority::Low, 4 * GIB)?;
        let (capturing, revoked) = (env.work.join("capturing"), env.work.join("revoked"));
        let (capturing, revoked) = (
            capturing.to_str().unwrap_or_default(),
            revoked.to_str().unwrap_or_default(),
        );
        let low_job = probe(
            env,
            Some(&low),
            &[
                "launch",
                "1",
                "capture-begin",
                "global",
                "capture-launch",
                "2",
                "touch",
                capturing,
                "wait",
                revoked,
                "capture-launch",
                "2",
                "capture-end",
                "launch",
                "1",
            ],
        );
        let high_job = probe(
            env,
            Some(&high),
            &[
                "wait", capturing, "launch", "1", "sleep", "100", "touch", revoked,
            ],
        );
        let (low_out, _, _) = beside(low_job, high_job)?;
        Ok(probe_verdict(&low_out))
    };
    run_it().unwrap_or_else(Verdict::fail)
}

/// A low-priority holder runs captures that fork to a second stream and join back
/// (`capture-join`, as `torch.cuda.Stream.wait_stream` does), while a high-priority job
/// takes the token and gives it back again and again: every capture completes.
pub fn join_under_churn(env: &StepEnv) -> Verdict {
    let run_it = || -> Result<Verdict, String> {
        let arbiter = start_arbiter(env, 500)?;
        let high = lease(&arbiter, "high", Priority::High, 4 * GIB)?;
        let low = lease(&arbiter, "low", Priority::Low, 4 * GIB)?;
        let mut args = vec!["launch", "1"];
        for _ in 0..5 {
            args.extend(["capture-join", "3", "sleep", "20"]);
        }
        args.extend(["sync"]);
        let job = probe(env, Some(&low), &args)
            .spawn()
            .map_err(|e| format!("starting the low job: {e}"))?;
        let (out, rounds) = churn_while(env, &high, job)?;
        let verdict = probe_verdict(&out);
        Ok(Verdict {
            detail: format!("{} ({rounds} churn rounds of the high job)", verdict.detail),
            ..verdict
        })
    };
    run_it().unwrap_or_else(Verdict::fail)
}

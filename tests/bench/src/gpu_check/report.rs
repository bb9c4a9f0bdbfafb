//! The results files, `gpu-check.md` and `gpu-check.json`, rewritten whole after every step
//! (each through a temporary file and a rename, so a reader never sees half of one).

use super::{bins::Bins, driver::Gpu, Outcome, StepResult};
use std::path::{Path, PathBuf};

pub struct Report {
    markdown: PathBuf,
    simulated: bool,
    gpu: Gpu,
    bins: Bins,
    steps: Vec<StepResult>,
}

impl Report {
    pub fn new(markdown: &Path, simulated: bool, gpu: &Gpu, bins: &Bins) -> Report {
        Report {
            markdown: markdown.to_path_buf(),
            simulated,
            gpu: gpu.clone(),
            bins: bins.clone(),
            steps: Vec::new(),
        }
    }

    pub fn kind(&self) -> &'static str {
        if self.simulated {
            "SIMULATED GPU, not a real one (every figure is simulated)"
        } else {
            "real GPU"
        }
    }

    pub fn push(&mut self, step: StepResult) {
        self.steps.push(step);
    }

    pub fn failed(&self) -> Vec<&'static str> {
        self.steps
            .iter()
            .filter(|s| s.outcome == Outcome::Fail)
            .map(|s| s.name)
            .collect()
    }

    pub fn skipped(&self) -> usize {
        self.steps
            .iter()
            .filter(|s| s.outcome == Outcome::Skip)
            .count()
    }

    pub fn markdown(&self) -> String {
        let mut md = format!(
            "# gpu-check ({})\n\nGPU: {}\n\nBinaries: {} ({}), interposer {}, revision {}\n\n\
             | step | checks | result | seconds | seen |\n|---|---|---|---|---|\n",
            self.kind(),
            self.gpu.summary(),
            self.bins.dir.display(),
            self.bins.source,
            self.bins.preload.display(),
            self.bins.revision,
        );
        for s in &self.steps {
            md += &format!(
                "| {} | {} | {} | {:.1} | {} |\n",
                s.name,
                s.what,
                s.outcome.label(),
                s.seconds,
                s.detail.replace('|', "/").replace('\n', "; ")
            );
        }
        md
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "simulated": self.simulated,
            "gpu": self.gpu,
            "binaries": self.bins,
            "steps": self.steps,
        })
    }

    /// Rewrites both files with every step so far.
    pub fn write(&self) -> std::io::Result<()> {
        let json = serde_json::to_vec_pretty(&self.json()).map_err(std::io::Error::other)?;
        replace(&self.markdown, self.markdown().as_bytes())?;
        replace(&self.markdown.with_extension("json"), &json)
    }
}

fn replace(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

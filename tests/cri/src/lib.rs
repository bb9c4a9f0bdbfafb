//! A CRI (runtime.v1) client for end-to-end tests through containerd's CRI plugin, playing kubelet

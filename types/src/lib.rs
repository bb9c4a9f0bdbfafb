//! gpushare's shared vocabulary: priorities, sizes, fractions, GPU selectors, lease ids, the token clock and the host path layout

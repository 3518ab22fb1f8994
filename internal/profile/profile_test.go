package profile

import (
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
)

func TestLookup(t *testing.T) {
	for _, tc := range []struct {
		release, name, kubevirt, sim, real string
	}{
		{"1.6", "1.6", "v1.5.2", "legacy-v1.5.3", ""},
		{"1.6.1", "1.6", "v1.5.2", "legacy-v1.5.3", ""},
		{"1.7.0", "1.7.0", "v1.6.3", "legacy-v1.6.3", "real-legacy-v1.6.0"},
		{"1.7.1", "1.7.0", "v1.6.3", "legacy-v1.6.3", "real-legacy-v1.6.0"},
		{"1.7.3", "1.7.2", "v1.6.6", "legacy-v1.6.6", "real-legacy-v1.6.0"},
		{"1.7", "1.7.2", "v1.6.6", "legacy-v1.6.6", "real-legacy-v1.6.0"},
		{"v1.8.0", "1.8.0", "v1.7.0", "declarative-v1.7.0", "real-declarative-v1.7.0"},
		{"1.8.1", "1.8.0", "v1.7.0", "declarative-v1.7.0", "real-declarative-v1.7.0"},
		{"1.8.2", "1.8.2", "v1.7.4", "declarative-v1.7.4", "real-declarative-v1.7.0"},
		{"1.8.5", "1.8.2", "v1.7.4", "declarative-v1.7.4", "real-declarative-v1.7.0"},
		{"1.8", "1.8.2", "v1.7.4", "declarative-v1.7.4", "real-declarative-v1.7.0"},
		{"1.9.0", "1.9", "v1.8.4", "declarative-v1.8.2", "real-declarative-v1.8.4"},
	} {
		p, err := Lookup(tc.release)
		if err != nil {
			t.Errorf("Lookup(%q): %v", tc.release, err)
			continue
		}
		if p.Name != tc.name || p.KubeVirt != tc.kubevirt || p.SimKubeVirt() != tc.sim {
			t.Errorf("Lookup(%q) = %s (KubeVirt %s, sim %s), want %s (%s, %s)", tc.release, p.Name, p.KubeVirt, p.SimKubeVirt(), tc.name, tc.kubevirt, tc.sim)
		}
		real, err := p.RealKubeVirt()
		if tc.real == "" {
			if err == nil || !strings.Contains(err.Error(), "no real control plane") {
				t.Errorf("Lookup(%q).RealKubeVirt() = %q, %v; want the no-real-control-plane error", tc.release, real, err)
			}
		} else if err != nil || real != tc.real {
			t.Errorf("Lookup(%q).RealKubeVirt() = %q, %v; want %q", tc.release, real, err, tc.real)
		}
	}
}

func TestLookupErrors(t *testing.T) {
	for _, release := range []string{"", "1", "1.5.0", "1.10", "2.0.0", "1.8.x", "latest", "1.8.0.1"} {
		if p, err := Lookup(release); err == nil {
			t.Errorf("Lookup(%q) = %s, want an error", release, p.Name)
		} else if !strings.Contains(err.Error(), "1.8.0, 1.8.1") {
			t.Errorf("Lookup(%q): %v, want the known releases listed", release, err)
		}
	}
}

// Every profile must name a simulated KubeVirt the simulator has and a
// real tag internal/realkubevirt builds, in a mode that KubeVirt has.
func TestProfilesConsistent(t *testing.T) {
	builds := map[string]bool{"v1.6.0": true, "v1.7.0": true, "v1.8.2": true, "v1.8.4": true}
	for _, p := range All() {
		if _, err := kubevirtsim.ParseVersion(string(p.Sim)); err != nil {
			t.Errorf("%s: simulated version %s: %v", p.Name, p.Sim, err)
		}
		if p.Real != "" && !builds[p.Real] {
			t.Errorf("%s: real tag %s does not build here", p.Name, p.Real)
		}
		if p.Mode == kubevirtsim.ModeDeclarative && p.Sim == kubevirtsim.V1_5_3 {
			t.Errorf("%s: KubeVirt 1.5 has no declarative hotplug", p.Name)
		}
	}
}

// has16159 says whether KubeVirt version v ("v1.M.P") has kubevirt PR
// 16159 (an attachment pod being deleted is not the current one): merged
// for v1.8.0, backported to v1.6.4 (PR 16219) and v1.7.1 (PR 16199).
func has16159(t *testing.T, v string) bool {
	t.Helper()
	var minor, patch int
	if _, err := fmt.Sscanf(v, "v1.%d.%d", &minor, &patch); err != nil {
		t.Fatalf("KubeVirt version %q: %v", v, err)
	}
	switch minor {
	case 6:
		return patch >= 4
	case 7:
		return patch >= 1
	}
	return minor >= 8
}

// A profile's simulated KubeVirt plays PR 16159 exactly when the release's
// KubeVirt has it, and a real tag that lacks it while the release has it
// names the gap.
func TestPatchLevelPR16159(t *testing.T) {
	for _, p := range All() {
		if got, want := has16159(t, string(p.Sim)), has16159(t, p.KubeVirt); got != want {
			t.Errorf("Harvester %s: simulated %s has PR 16159 %v, its KubeVirt %s %v", p.Name, p.Sim, got, p.KubeVirt, want)
		}
		if p.Real == "" {
			continue
		}
		gap := has16159(t, p.KubeVirt) && !has16159(t, p.Real)
		named := slices.ContainsFunc(p.RealGaps, func(g string) bool { return strings.Contains(g, "PR 16159") })
		if gap != named {
			t.Errorf("Harvester %s: KubeVirt %s on tag %s: gap %v, RealGaps %q", p.Name, p.KubeVirt, p.Real, gap, p.RealGaps)
		}
	}
}

package lab

import (
	"strings"
	"testing"
	"time"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/simharvester"
)

func TestParseKubeVirt(t *testing.T) {
	for name, want := range map[string]struct {
		mode    kubevirtsim.Mode
		version kubevirtsim.Version
	}{
		"":                   {kubevirtsim.ModeLegacy, kubevirtsim.V1_5_3},
		"legacy-v1.5":        {kubevirtsim.ModeLegacy, kubevirtsim.V1_5_3},
		"legacy-v1.7":        {kubevirtsim.ModeLegacy, kubevirtsim.V1_6_3},
		"declarative":        {kubevirtsim.ModeDeclarative, kubevirtsim.V1_7_0},
		"v1.6.3":             {kubevirtsim.ModeLegacy, kubevirtsim.V1_6_3},
		"v1.6.6":             {kubevirtsim.ModeLegacy, kubevirtsim.V1_6_6},
		"1.7.4":              {kubevirtsim.ModeDeclarative, kubevirtsim.V1_7_4},
		"1.7.0":              {kubevirtsim.ModeDeclarative, kubevirtsim.V1_7_0},
		"legacy-v1.7.0":      {kubevirtsim.ModeLegacy, kubevirtsim.V1_7_0},
		"declarative-v1.8.2": {kubevirtsim.ModeDeclarative, kubevirtsim.V1_8_2},
		"main":               {kubevirtsim.ModeDeclarative, kubevirtsim.VMain},
	} {
		mode, version, err := ParseKubeVirt(name)
		if err != nil || mode != want.mode || version != want.version {
			t.Errorf("ParseKubeVirt(%q) = %s, %s, %v; want %s, %s", name, mode, version, err, want.mode, want.version)
		}
	}
	for _, bad := range []string{"v1.4.0", "declarative-v1.5.3", "legacy-", "nonsense"} {
		if _, _, err := ParseKubeVirt(bad); err == nil {
			t.Errorf("ParseKubeVirt(%q) accepted", bad)
		}
	}
}

// "real-" picks KubeVirt's own control plane of a tag, with the hotplug
// Harvester runs that line with unless a mode is named; simulated names are
// not real ones, and the faults only the simulator plays are refused.
func TestParseRealKubeVirt(t *testing.T) {
	for name, want := range map[string]struct {
		tag  string
		mode kubevirtsim.Mode
	}{
		"real-v1.7.0":             {"v1.7.0", kubevirtsim.ModeDeclarative},
		"real-v1.6.0":             {"v1.6.0", kubevirtsim.ModeLegacy},
		"real-legacy-v1.7.0":      {"v1.7.0", kubevirtsim.ModeLegacy},
		"real-declarative-v1.8.2": {"v1.8.2", kubevirtsim.ModeDeclarative},
	} {
		tag, mode, ok, err := ParseRealKubeVirt(name)
		if !ok || err != nil || tag != want.tag || mode != want.mode {
			t.Errorf("ParseRealKubeVirt(%q) = %q, %s, %v, %v; want %q, %s", name, tag, mode, ok, err, want.tag, want.mode)
		}
		c := Config{KubeVirt: name, TimeScale: 1}
		o, err := c.simOptions()
		if err != nil || o.Mode != want.mode {
			t.Errorf("simOptions for %q: mode %s, %v; want %s", name, o.Mode, err, want.mode)
		}
		if h := hostOptions("/out", name, o, nil, 0); h.Real != want.tag {
			t.Errorf("hostOptions for %q: Real %q, want %q", name, h.Real, want.tag)
		}
	}
	for _, sim := range []string{"declarative", "v1.7.0", "legacy-v1.7.0"} {
		if _, _, ok, err := ParseRealKubeVirt(sim); ok || err != nil {
			t.Errorf("ParseRealKubeVirt(%q) = real %v, %v; want a simulated name", sim, ok, err)
		}
		if h := hostOptions("/out", sim, kubevirtsim.Options{}, nil, 0); h.Real != "" {
			t.Errorf("hostOptions for %q runs the real control plane %q", sim, h.Real)
		}
	}
	for _, bad := range []string{"real-", "real-legacy-", "real-main", "real-1.7"} {
		if _, _, ok, err := ParseRealKubeVirt(bad); !ok || err == nil {
			t.Errorf("ParseRealKubeVirt(%q) accepted (real %v)", bad, ok)
		}
	}
	c := Config{KubeVirt: "real-v1.7.0", DenyHotplug: 0.1}
	if _, err := c.simOptions(); err == nil || !strings.Contains(err.Error(), "--deny-hotplug") {
		t.Errorf("the deny-hotplug fault on the real control plane: %v, want a refusal naming it", err)
	}
}

// On the real control plane nothing counts the driver's KubeVirt writes, so
// the summary says so instead of printing zeros.
func TestSummaryOnTheRealControlPlaneCountsNoWrites(t *testing.T) {
	for name, wantCounted := range map[string]bool{"real-v1.7.0": false, "declarative": true} {
		got := (&Report{Config: Config{KubeVirt: name}}).Summary()
		if counted := strings.Contains(got, "KubeVirt writes: 0"); counted != wantCounted {
			t.Errorf("--kubevirt %s: summary prints write counts %v, want %v:\n%s", name, counted, wantCounted, got)
		}
		if notCounted := strings.Contains(got, "not counted"); notCounted == wantCounted {
			t.Errorf("--kubevirt %s: summary says not counted %v, want %v:\n%s", name, notCounted, !wantCounted, got)
		}
	}
}

func TestHarvesterKubeVirt(t *testing.T) {
	for _, tc := range []struct {
		release  string
		real     bool
		kubevirt string
		want     string
	}{
		{"1.6.0", false, "", "legacy-v1.5.3"},
		{"1.7.1", false, "", "legacy-v1.6.3"},
		{"1.8.0", false, "", "declarative-v1.7.0"},
		{"1.8.0", true, "", "real-declarative-v1.7.0"},
		{"1.9", true, "", "real-declarative-v1.8.4"},
		// Names that agree with the profile are kept as given.
		{"1.6.1", false, KubeVirtLegacyV15, KubeVirtLegacyV15},
		{"1.7.0", false, KubeVirtLegacyV17, KubeVirtLegacyV17},
		{"1.8.1", false, KubeVirtDeclarative, KubeVirtDeclarative},
		{"1.8.0", false, "v1.7.0", "v1.7.0"},
		{"1.8.0", false, "real-v1.7.0", "real-v1.7.0"},
		{"1.8.0", true, "real-declarative-v1.7.0", "real-declarative-v1.7.0"},
	} {
		got, err := HarvesterKubeVirt(tc.release, tc.real, tc.kubevirt)
		if err != nil || got != tc.want {
			t.Errorf("HarvesterKubeVirt(%s, real %v, --kubevirt %q) = %q, %v; want %q", tc.release, tc.real, tc.kubevirt, got, err, tc.want)
		}
	}
}

func TestHarvesterKubeVirtErrors(t *testing.T) {
	for _, tc := range []struct {
		release  string
		real     bool
		kubevirt string
		want     string
	}{
		{"1.5.0", false, "", "no profile"},
		{"one.eight", false, "", "want X.Y or X.Y.Z"},
		{"1.6.0", true, "", "no real control plane"},
		{"1.8.0", false, KubeVirtLegacyV15, "disagree"},
		{"1.8.0", false, "legacy-v1.7.0", "disagree"},
		{"1.8.0", true, "declarative", "disagree"},
		{"1.8.0", false, "real-v1.8.2", "disagree"},
		{"1.7.0", false, "real-declarative-v1.6.0", "disagree"},
		{"1.8.0", false, "v9", "disagree"},
	} {
		got, err := HarvesterKubeVirt(tc.release, tc.real, tc.kubevirt)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("HarvesterKubeVirt(%s, real %v, --kubevirt %q) = %q, %v; want an error with %q", tc.release, tc.real, tc.kubevirt, got, err, tc.want)
		}
	}
}

func TestSummaryNamesTheHarvesterRelease(t *testing.T) {
	got := (&Report{Config: Config{KubeVirt: "declarative-v1.7.0", Harvester: "1.8.0"}}).Summary()
	if !strings.Contains(got, "Harvester 1.8.0") {
		t.Errorf("summary does not name --harvester 1.8.0:\n%s", got)
	}
}

// The host serves the webhooks of the --harvester release, and the outage
// fault refuses to run without them.
func TestWebhooksFollowTheRelease(t *testing.T) {
	for release, want := range map[string]simharvester.Release{"1.6.0": simharvester.V1_6, "1.7.2": simharvester.V1_7, "1.8.2": simharvester.V1_8, "": ""} {
		c := &Config{Harvester: release}
		if got, err := c.webhooks(); err != nil || got != want {
			t.Errorf("--harvester %q: webhooks %q, %v; want %q", release, got, err, want)
		}
	}
	c := &Config{WebhookOutage: time.Second}
	if _, err := c.webhooks(); err == nil {
		t.Error("--webhook-outage without --harvester accepted")
	}
}

// The lab's --host-nodes reaches the host as its host storage path, with
// Longhorn at the simulator's time scale.
func TestHostOptionsWithHostNodes(t *testing.T) {
	sim := kubevirtsim.Options{Scale: 0.1, Jitter: 0.2, Seed: 7}
	h := hostOptions("/out", "real-legacy-v1.7.0", sim, []string{"n-0"}, 3)
	if !h.HostStorage || h.HostNodes != 3 || h.Longhorn.Scale != 0.1 || h.Longhorn.Jitter != 0.2 || h.HostNodeStatusUpdate != time.Second {
		t.Errorf("hostOptions with 3 host nodes: HostStorage %v, HostNodes %d, Longhorn %+v, status every %v", h.HostStorage, h.HostNodes, h.Longhorn, h.HostNodeStatusUpdate)
	}
	if h := hostOptions("/out", "", sim, []string{"n-0"}, 3); !h.HostStorage || h.Real != "" || h.HostNodes != 3 {
		t.Errorf("hostOptions with 3 host nodes on the simulator: HostStorage %v, Real %q, HostNodes %d", h.HostStorage, h.Real, h.HostNodes)
	}
	if h := hostOptions("/out", "real-legacy-v1.7.0", sim, nil, 0); h.HostStorage {
		t.Error("hostOptions without host nodes turns host storage on")
	}
}

// On the real control plane --harvester picks the virt-handler its node
// agents play: the release's own KubeVirt patch level on the nearest tag
// that builds (Harvester 1.8.2 runs KubeVirt 1.7.4 on v1.7.0's control
// plane), with the control-plane changes that tag lacks as gaps.
func TestHostPlaysHarvesterRelease(t *testing.T) {
	for _, tc := range []struct {
		harvester string
		real      bool
		tag, rel  string
		gaps      int
	}{
		{"1.8.2", true, "v1.7.0", "v1.7.4", 1},
		{"1.8.0", true, "v1.7.0", "v1.7.0", 0},
		{"1.7.2", true, "v1.6.0", "v1.6.6", 1},
		{"1.7.0", true, "v1.6.0", "v1.6.3", 0},
		{"1.9", true, "v1.8.4", "v1.8.4", 0},
		{"1.8.2", false, "", "", 0},
	} {
		kv, err := HarvesterKubeVirt(tc.harvester, tc.real, "")
		if err != nil {
			t.Fatalf("--harvester %s (real %v): %v", tc.harvester, tc.real, err)
		}
		c := &Config{Out: "/out", Harvester: tc.harvester, KubeVirt: kv}
		sim, err := c.simOptions()
		if err != nil {
			t.Fatalf("--harvester %s: %v", tc.harvester, err)
		}
		h, gaps, err := c.host(sim, []string{"node-0"})
		if err != nil || h.Real != tc.tag || h.RealRelease != tc.rel || len(gaps) != tc.gaps {
			t.Errorf("--harvester %s (real %v): host on %q playing %q, gaps %q, %v; want %q playing %q, %d gaps", tc.harvester, tc.real, h.Real, h.RealRelease, gaps, err, tc.tag, tc.rel, tc.gaps)
		}
	}
	// Without --harvester the tag plays its own virt-handler.
	c := &Config{Out: "/out", KubeVirt: "real-declarative-v1.7.0"}
	if h, gaps, err := c.host(kubevirtsim.Options{}, nil); err != nil || h.Real != "v1.7.0" || h.RealRelease != "" || gaps != nil {
		t.Errorf("--kubevirt real-declarative-v1.7.0: host on %q playing %q, gaps %q, %v", h.Real, h.RealRelease, gaps, err)
	}
	// A release on a tag its profile does not name is refused.
	c = &Config{Out: "/out", Harvester: "1.8.2", KubeVirt: "real-declarative-v1.8.2"}
	if _, _, err := c.host(kubevirtsim.Options{}, nil); err == nil || !strings.Contains(err.Error(), "disagree") {
		t.Errorf("--harvester 1.8.2 on v1.8.2: %v; want a disagreement", err)
	}
}

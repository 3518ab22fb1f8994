// Package profile names the KubeVirt each Harvester release runs, so that
// the lab and the benchmarks can be asked for "Harvester 1.8.0" instead of
// a KubeVirt version and hotplug mode picked by hand.
package profile

import (
	"fmt"
	"regexp"
	"strconv"
	"strings"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/simharvester"
)

// Profile is one line of Harvester releases that run the same KubeVirt.
type Profile struct {
	// Name is the release line as users say it ("1.8.2").
	Name string
	// Releases are the Harvester releases it covers, as shown to users.
	Releases string
	// KubeVirt is the KubeVirt the release's chart deploys, to the patch
	// level. On the real control plane it names the virt-handler the node
	// agents play (realkubevirt.Options.Release), so a release whose patch
	// level no tag here builds still gets its own node agent.
	KubeVirt string
	// Mode is the hotplug feature gate the release's chart turns on.
	Mode kubevirtsim.Mode
	// Sim is the simulator's version nearest to KubeVirt in hotplug
	// behaviour.
	Sim kubevirtsim.Version
	// Real is the nearest KubeVirt tag internal/realkubevirt builds, ""
	// when none is near enough to stand in for it. What the tag's
	// virt-controller and virt-api lack of KubeVirt is in RealGaps.
	Real string
	// RealGaps are the control-plane changes between Real and KubeVirt
	// that alter what a driver can see and that the real control plane
	// does not play (docs/architecture.md, "KubeVirt patch levels per
	// Harvester release").
	RealGaps []string
	// Webhooks are the rules and messages of the release's own admission
	// webhooks (internal/simharvester), read at harvester/harvester's tags.
	Webhooks simharvester.Release
	// minor, from, to: the patch releases x.minor.from..to it covers (to <
	// 0: and every later one).
	minor, from, to int
}

// Profiles, oldest first. KubeVirt is the virt-operator image tag
// (`kubevirtVersion`) and Mode the featureGates of kubevirt.spec in
// harvester/harvester deploy/charts/harvester/values.yaml at each tag.
var profiles = []Profile{
	// v1.6.0, v1.6.1: tag 1.5.2-150700.3.5.2, featureGates HotplugVolumes.
	// No KubeVirt 1.5 tag builds here (its client-go is not served).
	{Name: "1.6", Releases: "1.6.x", KubeVirt: "v1.5.2", Mode: kubevirtsim.ModeLegacy, Sim: kubevirtsim.V1_5_3, Webhooks: simharvester.V1_6, minor: 6, from: 0, to: -1},
	// v1.7.0, v1.7.1: tag 1.6.3-150700.3.13.1, featureGates HotplugVolumes
	// (v1.7.0 values.yaml:71). v1.6.3 does not build here; v1.6.0 does.
	{Name: "1.7.0", Releases: "1.7.0, 1.7.1", KubeVirt: "v1.6.3", Mode: kubevirtsim.ModeLegacy, Sim: kubevirtsim.V1_6_3, Real: "v1.6.0", Webhooks: simharvester.V1_7, minor: 7, from: 0, to: 1},
	// v1.7.2, v1.7.3: tag 1.6.6-150700.15.7.1, HotplugVolumes. 1.6.6 has
	// kubevirt PR 16159, which v1.6.3 and v1.6.0 lack.
	{Name: "1.7.2", Releases: "1.7.2 and later 1.7", KubeVirt: "v1.6.6", Mode: kubevirtsim.ModeLegacy, Sim: kubevirtsim.V1_6_6, Real: "v1.6.0", RealGaps: []string{gapPR16159}, Webhooks: simharvester.V1_7, minor: 7, from: 2, to: -1},
	// v1.8.0: tag 1.7.0-150700.3.16.2, v1.8.1: 1.7.0-150700.3.21.1;
	// featureGates DeclarativeHotplugVolumes (v1.8.0 values.yaml:73).
	{Name: "1.8.0", Releases: "1.8.0, 1.8.1", KubeVirt: "v1.7.0", Mode: kubevirtsim.ModeDeclarative, Sim: kubevirtsim.V1_7_0, Real: "v1.7.0", Webhooks: simharvester.V1_8, minor: 8, from: 0, to: 1},
	// v1.8.2: tag 1.7.4-150700.3.24.2, DeclarativeHotplugVolumes. 1.7.4
	// lacks the Detaching reset of KubeVirt 1.8.2, so the nearest real
	// control plane is v1.7.0, not v1.8.2; 1.7.4 has kubevirt PR 16159,
	// which v1.7.0 lacks.
	{Name: "1.8.2", Releases: "1.8.2 and later 1.8", KubeVirt: "v1.7.4", Mode: kubevirtsim.ModeDeclarative, Sim: kubevirtsim.V1_7_4, Real: "v1.7.0", RealGaps: []string{gapPR16159}, Webhooks: simharvester.V1_8, minor: 8, from: 2, to: -1},
	// v1.9.0-rc6: tag 1.8.4-5.2, DeclarativeHotplugVolumes
	// (values.yaml:75); released 1.9 may differ. Its webhooks are taken to
	// be 1.8's (not read at a 1.9 tag).
	{Name: "1.9", Releases: "1.9 (release candidates)", KubeVirt: "v1.8.4", Mode: kubevirtsim.ModeDeclarative, Sim: kubevirtsim.V1_8_2, Real: "v1.8.4", Webhooks: simharvester.V1_8, minor: 9, from: 0, to: -1},
}

// gapPR16159: from kubevirt PR 16159 on, virt-controller does not take an
// attachment pod being deleted as the current one although its volumes
// match (v1.6.6 and v1.7.4 pkg/virt-controller/watch/vmi/volume-hotplug.go:59-62,
// against :59 at v1.6.0 and v1.7.0). The choice reads the pod's own spec
// volumes and deletion timestamp, which nothing beside virt-controller can
// change, so the older tag plays the older choice.
const gapPR16159 = "kubevirt PR 16159: an attachment pod being deleted still counts as current (a new one is created only once it is gone)"

// All returns every profile, oldest first.
func All() []Profile { return append([]Profile(nil), profiles...) }

var releaseRE = regexp.MustCompile(`^v?(\d+)\.(\d+)(?:\.(\d+))?$`)

// Lookup finds the profile of a Harvester release "X.Y" or "X.Y.Z" (a
// leading v is accepted). "X.Y" alone means the newest patch release of
// that line, the one an up-to-date cluster runs.
func Lookup(release string) (Profile, error) {
	m := releaseRE.FindStringSubmatch(release)
	if m == nil {
		return Profile{}, fmt.Errorf("harvester release %q: want X.Y or X.Y.Z, one of %s", release, known())
	}
	major, _ := strconv.Atoi(m[1])
	minor, _ := strconv.Atoi(m[2])
	patch := -1
	if m[3] != "" {
		patch, _ = strconv.Atoi(m[3])
	}
	var found *Profile
	for i := range profiles {
		p := &profiles[i]
		if major != 1 || p.minor != minor {
			continue
		}
		if patch < 0 || (patch >= p.from && (p.to < 0 || patch <= p.to)) {
			found = p
		}
	}
	if found == nil {
		return Profile{}, fmt.Errorf("harvester release %q: no profile, known: %s", release, known())
	}
	return *found, nil
}

// SimKubeVirt is the lab's --kubevirt name of the simulated KubeVirt.
func (p Profile) SimKubeVirt() string { return string(p.Mode) + "-" + string(p.Sim) }

// RealKubeVirt is the lab's --kubevirt name of the real control plane, or
// an error when no KubeVirt tag that builds here is near enough.
func (p Profile) RealKubeVirt() (string, error) {
	if p.Real == "" {
		return "", fmt.Errorf("harvester %s runs KubeVirt %s, which has no real control plane here (no tag of its line builds); use the simulated one", p.Releases, p.KubeVirt)
	}
	return "real-" + string(p.Mode) + "-" + p.Real, nil
}

func known() string {
	names := make([]string, len(profiles))
	for i, p := range profiles {
		names[i] = p.Releases
	}
	return strings.Join(names, "; ")
}

package kubevirtsim

import (
	"fmt"
	"slices"
	"strings"
)

// Version is a KubeVirt release the simulator reproduces. Every
// version-dependent behaviour is derived from it (see the package doc for
// the list, with the KubeVirt source each one comes from).
type Version string

// The simulated KubeVirt releases. Harvester 1.6 ships KubeVirt 1.5.x,
// Harvester 1.7.0 ships 1.6.3 and 1.7.2 ships 1.6.6 (legacy hotplug),
// Harvester 1.8.0 ships 1.7.0 and 1.8.2 ships 1.7.4 (declarative hotplug).
// A patch release is its own version only where its hotplug paths differ
// from the previous one in what a driver can see (docs/architecture.md,
// "KubeVirt patch levels per Harvester release").
const (
	V1_5_3 Version = "v1.5.3"
	V1_6_3 Version = "v1.6.3"
	// V1_6_6 is v1.6.3 with kubevirt PR 16159 (backported to release-1.6
	// by PR 16219, first in v1.6.4).
	V1_6_6 Version = "v1.6.6"
	V1_7_0 Version = "v1.7.0"
	// V1_7_4 is v1.7.0 with kubevirt PR 16159 (backported to release-1.7
	// by PR 16199, first in v1.7.1).
	V1_7_4 Version = "v1.7.4"
	V1_8_2 Version = "v1.8.2"
	// VMain is kubevirt/kubevirt main past v1.9.0-rc.2.
	VMain Version = "main"
)

// Versions lists the simulated releases, oldest first.
func Versions() []Version { return []Version{V1_5_3, V1_6_3, V1_6_6, V1_7_0, V1_7_4, V1_8_2, VMain} }

// ParseVersion returns the version with this name ("v1.6.3", "1.6.3" or
// "main").
func ParseVersion(name string) (Version, error) {
	v := Version(name)
	if name != "" && name != string(VMain) && !strings.HasPrefix(name, "v") {
		v = Version("v" + name)
	}
	if !slices.Contains(Versions(), v) {
		return "", fmt.Errorf("kubevirtsim: unknown KubeVirt version %q (want one of %v)", name, Versions())
	}
	return v, nil
}

// features are the behaviour switches of a version. Each field names the
// KubeVirt source it follows; doc.go lists them all.
type features struct {
	// declarativeGate: the DeclarativeHotplugVolumes gate exists (added in
	// v1.6.0, pkg/virt-config/featuregate/active.go:104).
	declarativeGate bool
	// declarativeByDefault: the gate is Beta, on unless disabled (main,
	// pkg/virt-config/featuregate/active.go:311 and feature-gates.go:111).
	declarativeByDefault bool
	// v15Messages: virt-api's v1.5 feature-gate messages (v1.5.3
	// pkg/virt-api/rest/subresource.go:1169, 1231), the status validator's
	// scsi-only bus rule (v1.5.3
	// pkg/virt-api/webhooks/validating-webhook/admitters/vms-admitter.go:471)
	// and the VMI update validator's v1.5 hotplug disk messages (v1.5.3
	// vmi-update-admitter.go:144-259).
	v15Messages bool
	// ownedVMICheck: the VMI subresources refuse a VM-owned VMI when the
	// legacy gate is off (v1.6.3 pkg/virt-api/rest/volumes.go:221).
	ownedVMICheck bool
	// keepMountedOnUnplug: a removed volume keeps phase Ready/MountedToPod
	// until virt-handler unmounts it, and its old attachment pod is kept
	// until then (v1.6.3 pkg/virt-controller/watch/vmi/storage.go:262
	// phaseForUnpluggedVolume, volume-hotplug.go:99-111). v1.5.3 writes
	// Detaching at once and deletes the pod (vmi/vmi.go:1695, 2114).
	keepMountedOnUnplug bool
	// terminatingPodIsCurrent: an attachment pod being deleted still counts
	// as the current pod when its volumes match (v1.5.3 vmi.go:1673,
	// v1.6.3/v1.7.0 volume-hotplug.go:52); PR 16159 (v1.6.4, v1.7.1,
	// v1.8.0) skips it (v1.6.6/v1.7.4/v1.8.2 volume-hotplug.go:60).
	terminatingPodIsCurrent bool
	// resetDetachingOnReadd: a Detaching entry of a volume back in the spec
	// is reset to the PVC phase although a current pod exists (v1.8.2
	// pkg/virt-controller/watch/vmi/storage.go:199-204, PR 17139).
	resetDetachingOnReadd bool
	// keepOldPodOnlyIfUseful: the newest running old attachment pod is kept
	// while the new one starts only if it still holds a volume worth keeping
	// (main volume-hotplug.go:96-101, podContainsVolumesToPreserve at 144).
	keepOldPodOnlyIfUseful bool
	// waitHotplugBeforeStart: virt-handler starts the domain only once every
	// hotplug volume is MountedToPod or Ready (v1.6.0+
	// pkg/virt-handler/vm.go hotplugVolumesReady: v1.6.3:2219,
	// v1.7.0:2232, v1.8.2:2104). v1.5.3 starts at once.
	waitHotplugBeforeStart bool
	// pvcNotFoundMessage formats the volumeStatus message of a hotplug
	// volume whose claim is missing (v1.5.3 vmi.go:2178 "Unable to
	// determine PVC name"; v1.6.3 storage.go:282 "PVC %s not found").
	pvcNotFoundMessage func(claim string) string
	// virtAPIQPS and virtAPIBurst are virt-api's client budget to the API
	// server, which every addvolume and removevolume spends twice (the GET
	// and the patch): 5 QPS, burst 10 up to v1.6.3 (v1.5.3 and v1.6.3
	// pkg/virt-config/virt-config.go:87-88, set on virt-api's client in
	// pkg/virt-api/api.go:166,174); 200/400 from v1.6.4 (kubevirt commit
	// fb43befa6e). Harvester sets no apiConfiguration.restClient in its
	// KubeVirt CR (harvester v1.6.0-v1.8.0 deploy/charts/harvester/values.yaml),
	// so the default is what it runs.
	virtAPIQPS   float64
	virtAPIBurst int
	// observedVersion is the KubeVirt CR's status.observedKubeVirtVersion.
	observedVersion string
	// harvester is the Harvester release that ships this KubeVirt, for the
	// server-version setting.
	harvester string
}

func (v Version) features() features {
	f := features{
		declarativeGate:         true,
		ownedVMICheck:           true,
		keepMountedOnUnplug:     true,
		terminatingPodIsCurrent: true,
		waitHotplugBeforeStart:  true,
		pvcNotFoundMessage:      func(claim string) string { return fmt.Sprintf("PVC %s not found", claim) },
		observedVersion:         string(v),
		virtAPIQPS:              200,
		virtAPIBurst:            400,
	}
	switch v {
	case V1_5_3:
		f.declarativeGate, f.ownedVMICheck, f.keepMountedOnUnplug, f.waitHotplugBeforeStart = false, false, false, false
		f.v15Messages = true
		f.pvcNotFoundMessage = func(string) string { return "Unable to determine PVC name" }
		f.virtAPIQPS, f.virtAPIBurst = 5, 10
		f.harvester = "v1.6.0"
	case V1_6_3:
		f.virtAPIQPS, f.virtAPIBurst = 5, 10
		f.harvester = "v1.7.0"
	case V1_6_6:
		f.terminatingPodIsCurrent = false
		f.harvester = "v1.7.2"
	case V1_7_0:
		f.harvester = "v1.8.0"
	case V1_7_4:
		f.terminatingPodIsCurrent = false
		f.harvester = "v1.8.2"
	case V1_8_2:
		f.terminatingPodIsCurrent = false
		f.resetDetachingOnReadd = true
		f.harvester = "v1.9.0"
	case VMain:
		f.terminatingPodIsCurrent = false
		f.resetDetachingOnReadd = true
		f.keepOldPodOnlyIfUseful = true
		f.declarativeByDefault = true
		f.observedVersion = "v1.9.0"
		f.harvester = "v1.9.0"
	}
	return f
}

// HarvesterRelease is the Harvester release that ships this KubeVirt (its
// server-version setting), "" for a version the simulator does not have.
func (v Version) HarvesterRelease() string { return v.features().harvester }

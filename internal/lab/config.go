package lab

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/profile"
	"github.com/harvester-csi/harvester-csi-driver/internal/simharvester"
	"github.com/harvester-csi/harvester-csi-driver/internal/simhost"
	"github.com/harvester-csi/harvester-csi-driver/internal/simlonghorn"
)

// AgentImage is the image the hollow kubelets run the agent for.
const AgentImage = "hcsi-lab.local/agent:v1"

// KubeVirt versions the lab simulates.
const (
	KubeVirtLegacyV15   = "legacy-v1.5"
	KubeVirtLegacyV17   = "legacy-v1.7"
	KubeVirtDeclarative = "declarative"
)

// Config is one lab run.
type Config struct {
	Nodes      int     `json:"nodes"`
	Namespaces int     `json:"namespaces"`
	Minutes    float64 `json:"minutes"`
	KubeVirt   string  `json:"kubevirt"`
	// Harvester is the release --harvester named, KubeVirt then being
	// the one its profile (internal/profile) runs.
	Harvester  string        `json:"harvester,omitempty"`
	TimeScale  float64       `json:"time_scale"`
	Seed       uint64        `json:"seed"`
	StuckBound time.Duration `json:"stuck_bound"`
	// LabJobs: Jobs created by the lab every JobInterval instead of by
	// CronJobs (the --quick preset).
	LabJobs      bool          `json:"lab_jobs"`
	JobInterval  time.Duration `json:"job_interval"`
	MoveInterval time.Duration `json:"move_interval"`
	// ExpandEvery: one database claim is expanded (by 512 MiB, online)
	// this often, then its database moved; 0: never.
	ExpandEvery time.Duration `json:"expand_every"`
	// DBFSType is set when the databases' claims do not use the chart's
	// class as is (see dbStorageClass).
	DBFSType string `json:"db_fstype,omitempty"`

	// Faults.
	SkipUnstage         float64       `json:"fault_skip_unstage"`
	ControllerKillEvery time.Duration `json:"fault_controller_kill_every"`
	APIPause            time.Duration `json:"fault_api_pause"`
	APIPauseEvery       time.Duration `json:"fault_api_pause_every"`
	AttachPodStuck      time.Duration `json:"fault_attachment_pod_stuck"`
	AttachPodStuckEvery time.Duration `json:"fault_attachment_pod_stuck_every"`
	StuckDetachOnReadd  bool          `json:"fault_stuck_detach_on_readd"`
	DenyHotplug         float64       `json:"fault_deny_hotplug"`
	// WebhookOutage takes Harvester's webhook service away this long, every
	// WebhookOutageEvery (default 4x), as an upgrade restarting its pod
	// does; needs Harvester (its webhooks are served then).
	WebhookOutage      time.Duration `json:"fault_webhook_outage"`
	WebhookOutageEvery time.Duration `json:"fault_webhook_outage_every"`
	// MigrateVMsEvery live-migrates every guest VM in turn this often, as a
	// Harvester upgrade does (migrate.go).
	MigrateVMsEvery time.Duration `json:"fault_migrate_vms_every,omitempty"`
	// DrainNodesEvery rolls the guest nodes this often, draining one at a
	// time, as an RKE2 upgrade does (drain.go).
	DrainNodesEvery time.Duration `json:"fault_drain_nodes_every,omitempty"`

	// Host faults, each on for its length every ...Every (default 4x its
	// length); they need host nodes (CheckHostFaults). LonghornFaulted: a
	// random attached Longhorn volume is faulted. CordonHost: the host
	// node of a random VM is cordoned, as Harvester's maintenance mode
	// does first. SlowHostDetach: Longhorn's detach stage takes
	// slowHostDetachFactor times as long. GhostWorkload: a random attached
	// volume's workloads list keeps an entry of a pod long gone.
	LonghornFaulted      time.Duration `json:"fault_longhorn_faulted,omitempty"`
	LonghornFaultedEvery time.Duration `json:"fault_longhorn_faulted_every,omitempty"`
	CordonHost           time.Duration `json:"fault_cordon_host,omitempty"`
	CordonHostEvery      time.Duration `json:"fault_cordon_host_every,omitempty"`
	SlowHostDetach       time.Duration `json:"fault_slow_host_detach,omitempty"`
	SlowHostDetachEvery  time.Duration `json:"fault_slow_host_detach_every,omitempty"`
	GhostWorkload        time.Duration `json:"fault_ghost_workload,omitempty"`
	GhostWorkloadEvery   time.Duration `json:"fault_ghost_workload_every,omitempty"`

	// HostNodes, when positive, runs the host storage path under each
	// attachment pod (simhost.Options.HostStorage) on that many host
	// nodes, under either control plane.
	HostNodes int `json:"host_nodes,omitempty"`

	// Out is the run directory; Bin the upstream binaries; DriverBinary the
	// driver; ControllerBinary an alternative controller process; Manifests
	// the rendered chart; AgentCommand how the hollow kubelets run the agent.
	Out              string   `json:"out"`
	Bin              string   `json:"-"`
	DriverBinary     string   `json:"driver_binary"`
	ControllerBinary string   `json:"controller_binary,omitempty"`
	Manifests        string   `json:"manifests"`
	AgentCommand     []string `json:"-"`
	// PrivateMountNamespace: the lab runs in its own mount namespace, so it
	// may mount in-cluster credentials for the driver processes at the
	// path every in-cluster client reads (upstream's driver needs them).
	PrivateMountNamespace bool `json:"-"`
	// Progress receives the live progress line; TTY updates it in place.
	Progress io.Writer `json:"-"`
	TTY      bool      `json:"-"`
}

// scaled is d at the run's time scale.
func (c *Config) scaled(d time.Duration) time.Duration {
	return time.Duration(float64(d) * c.TimeScale)
}

func (c *Config) simOptions() (kubevirtsim.Options, error) {
	o := kubevirtsim.Options{Scale: c.TimeScale, Jitter: 0.2, Seed: c.Seed}
	if tag, mode, ok, err := ParseRealKubeVirt(c.KubeVirt); ok || err != nil {
		// KubeVirt's own control plane keeps its own time; only the
		// hotplug mode (its CR's gates) comes from here.
		o.Mode = mode
		if err == nil {
			err = c.realFaults(tag)
		}
		return o, err
	}
	mode, version, err := ParseKubeVirt(c.KubeVirt)
	if err != nil {
		return o, err
	}
	o.Mode, o.Version = mode, version
	// The simulator reproduces the stuck re-add of the versions before
	// 1.8.2 by itself; the fault only makes sure the run uses one.
	if c.StuckDetachOnReadd && (version == kubevirtsim.V1_8_2 || version == kubevirtsim.VMain) {
		return o, fmt.Errorf("the stuck-detach-on-readd fault exists in KubeVirt before 1.8.2, not in %s: pick an older --kubevirt", version)
	}
	return o, nil
}

// hostOptions is the lab's Harvester: one VM per guest node, real disks
// that stop answering once unplugged, and what an installed Harvester gives
// the driver process (default class, online-expansion setting).
//
// With hostNodes, the host storage path runs under each attachment pod on
// that many host nodes, Longhorn's stand-in and the host kubelets' status
// period at the simulator's time scale.
func hostOptions(out, kubevirt string, sim kubevirtsim.Options, nodes []string, hostNodes int) simhost.Options {
	tag, _, _, _ := ParseRealKubeVirt(kubevirt)
	o := simhost.Options{
		Dir: filepath.Join(out, "host"), LogDir: filepath.Join(out, "logs"), Sim: sim, Real: tag, VMs: nodes,
		Disks: true, HardUnplug: true, Harvester: true,
	}
	if hostNodes > 0 {
		o.HostStorage, o.HostNodes = true, hostNodes
		o.Longhorn = simlonghorn.Options{Scale: sim.Scale, Jitter: sim.Jitter, Seed: int64(sim.Seed)} //nolint:gosec // a seed
		// The host kubelets' status period at the run's scale, as the
		// guest kubelets' is: volumesInUse goes out with it.
		if sim.Scale > 0 {
			o.HostNodeStatusUpdate = max(time.Second, time.Duration(float64(10*time.Second)*sim.Scale))
		}
	}
	return o
}

// host is the lab's Harvester for this run: hostOptions with the
// --harvester release's webhooks and, on the real control plane, the
// release's own virt-handler (a later patch release than the tag, such as
// 1.7.4 on v1.7.0 for Harvester 1.8.2). gaps are what the tag's
// virt-controller and virt-api lack of that release (profile.RealGaps).
func (c *Config) host(sim kubevirtsim.Options, nodes []string) (o simhost.Options, gaps []string, err error) {
	o = hostOptions(c.Out, c.KubeVirt, sim, nodes, c.HostNodes)
	if o.Webhooks, err = c.webhooks(); err != nil {
		return o, nil, err
	}
	if o.Real == "" || c.Harvester == "" {
		return o, nil, nil
	}
	p, err := profile.Lookup(c.Harvester)
	if err != nil {
		return o, nil, fmt.Errorf("--harvester: %w", err)
	}
	// HarvesterKubeVirt refuses a --kubevirt of another tag; a config
	// written by hand could still pair them, and the release's
	// virt-handler on a foreign tag would be neither.
	if p.Real != o.Real {
		return o, nil, fmt.Errorf("--kubevirt %s and --harvester %s disagree: Harvester %s runs on KubeVirt %s's control plane here", c.KubeVirt, c.Harvester, p.Releases, p.Real)
	}
	o.RealRelease = p.KubeVirt
	return o, p.RealGaps, nil
}

// webhooks are the Harvester webhooks the host serves: those of the
// --harvester release, none without one.
func (c *Config) webhooks() (simharvester.Release, error) {
	if c.Harvester == "" {
		if c.WebhookOutage > 0 {
			return "", errors.New("--webhook-outage needs --harvester: the release whose webhooks the host serves")
		}
		return "", nil
	}
	p, err := profile.Lookup(c.Harvester)
	if err != nil {
		return "", fmt.Errorf("--harvester: %w", err)
	}
	return p.Webhooks, nil
}

// RealPrefix in --kubevirt picks KubeVirt's real control plane
// (internal/realkubevirt) over the simulator.
const RealPrefix = "real-"

// ParseRealKubeVirt reads --kubevirt "real-[legacy-|declarative-]TAG": a
// KubeVirt tag hack/tools.sh builds (v1.6.0, v1.7.0, v1.8.2, v1.8.4). ok is
// false for a simulated name. Without a mode, a tag gets the hotplug
// Harvester runs it with: legacy on 1.6 (Harvester 1.7's line), declarative
// from 1.7 (Harvester 1.8).
func ParseRealKubeVirt(name string) (tag string, mode kubevirtsim.Mode, ok bool, err error) {
	rest, ok := strings.CutPrefix(name, RealPrefix)
	if !ok {
		return "", "", false, nil
	}
	for _, m := range []kubevirtsim.Mode{kubevirtsim.ModeLegacy, kubevirtsim.ModeDeclarative} {
		if after, found := strings.CutPrefix(rest, string(m)+"-"); found {
			mode, rest = m, after
		}
	}
	if !regexp.MustCompile(`^v\d+\.\d+\.\d+$`).MatchString(rest) {
		return "", "", true, fmt.Errorf("--kubevirt %q: want %s[legacy-|declarative-]vX.Y.Z, a KubeVirt tag hack/tools.sh builds", name, RealPrefix)
	}
	if mode == "" {
		mode = kubevirtsim.ModeDeclarative
		if strings.HasPrefix(rest, "v1.6.") {
			mode = kubevirtsim.ModeLegacy
		}
	}
	return rest, mode, true, nil
}

// HarvesterKubeVirt is the --kubevirt value --harvester release stands
// for: its profile's simulated KubeVirt, or with real its real control
// plane. kubevirt is --kubevirt when given too ("" if not): it must then
// name the same KubeVirt, so that a run never says one release and plays
// another.
func HarvesterKubeVirt(release string, real bool, kubevirt string) (string, error) {
	p, err := profile.Lookup(release)
	if err != nil {
		return "", fmt.Errorf("--harvester: %w", err)
	}
	want := p.SimKubeVirt()
	if _, _, isReal, _ := ParseRealKubeVirt(kubevirt); real || isReal {
		if want, err = p.RealKubeVirt(); err != nil {
			return "", fmt.Errorf("--harvester %s: %w", release, err)
		}
	}
	if kubevirt == "" {
		return want, nil
	}
	if !sameKubeVirt(kubevirt, want) {
		return "", fmt.Errorf("--kubevirt %s and --harvester %s disagree: Harvester %s runs KubeVirt %s, --kubevirt %s here", kubevirt, release, p.Releases, p.KubeVirt, want)
	}
	return kubevirt, nil
}

// sameKubeVirt says whether two --kubevirt values run the same KubeVirt
// in the same hotplug mode (a name and its long spelling do).
func sameKubeVirt(a, b string) bool {
	ta, ma, ra, errA := ParseRealKubeVirt(a)
	tb, mb, rb, errB := ParseRealKubeVirt(b)
	if ra || rb {
		return ra && rb && errA == nil && errB == nil && ta == tb && ma == mb
	}
	mA, vA, errA := ParseKubeVirt(a)
	mB, vB, errB := ParseKubeVirt(b)
	return errA == nil && errB == nil && mA == mB && vA == vB
}

// realFaults refuses the faults only the simulator can play: KubeVirt's
// own control plane has no switch for stuck attachment pods, a denying
// webhook or the stuck re-add. A live migration it carries out itself, but
// only on host nodes: the kubelet stand-in binds pods by name and would not
// keep the target virt-launcher pod off the source node as KubeVirt's
// required anti-affinity asks.
func (c *Config) realFaults(tag string) error {
	for name, on := range map[string]bool{
		"--attachment-pod-stuck":  c.AttachPodStuck > 0,
		"--deny-hotplug":          c.DenyHotplug > 0,
		"--stuck-detach-on-readd": c.StuckDetachOnReadd,
	} {
		if on {
			return fmt.Errorf("%s needs the simulated KubeVirt; KubeVirt %s's real control plane (--kubevirt %s%s) has no such switch", name, tag, RealPrefix, tag)
		}
	}
	if c.MigrateVMsEvery > 0 && c.HostNodes <= 0 {
		return fmt.Errorf("--migrate-vms on KubeVirt %s's real control plane (--kubevirt %s%s) needs host nodes (--host-nodes): the kubelet stand-in would not keep the target off the source node", tag, RealPrefix, tag)
	}
	return nil
}

// hostFaultFlags names each host fault's flag with its length and period.
func (c *Config) hostFaultFlags() []struct {
	name     string
	d, every time.Duration
} {
	return []struct {
		name     string
		d, every time.Duration
	}{
		{"--longhorn-faulted", c.LonghornFaulted, c.LonghornFaultedEvery},
		{"--cordon-host", c.CordonHost, c.CordonHostEvery},
		{"--slow-host-detach", c.SlowHostDetach, c.SlowHostDetachEvery},
		{"--ghost-workload", c.GhostWorkload, c.GhostWorkloadEvery},
	}
}

// CheckHostFaults refuses a host fault without host nodes (only the host
// storage path has a Longhorn volume, a host node or a workloads list to
// act on) and negative lengths or periods.
func (c *Config) CheckHostFaults() error {
	for _, f := range c.hostFaultFlags() {
		switch {
		case f.d < 0 || f.every < 0:
			return fmt.Errorf("%s and %s-every must not be negative", f.name, f.name)
		case f.d == 0 && f.every > 0:
			return fmt.Errorf("%s-every needs %s: how long the fault lasts", f.name, f.name)
		case f.d > 0 && c.HostNodes <= 0:
			return fmt.Errorf("%s needs host nodes (--host-nodes N): without them no Longhorn volume, host node or workloads list exists to act on", f.name)
		}
	}
	return nil
}

// ParseKubeVirt reads --kubevirt: "[legacy-|declarative-]VERSION" with a
// simulated KubeVirt version (v1.5.3, v1.6.3, v1.6.6, v1.7.0, v1.7.4, v1.8.2, main), or one
// of the short names legacy-v1.5, legacy-v1.7 and declarative. Without a
// mode, a version gets the hotplug Harvester ships it with: legacy up to
// 1.6.6 (Harvester 1.6 and 1.7), declarative from 1.7.0 (Harvester 1.8).
func ParseKubeVirt(name string) (kubevirtsim.Mode, kubevirtsim.Version, error) {
	switch name {
	case KubeVirtLegacyV15, "":
		return kubevirtsim.ModeLegacy, kubevirtsim.V1_5_3, nil
	case KubeVirtLegacyV17:
		return kubevirtsim.ModeLegacy, kubevirtsim.V1_6_3, nil
	case KubeVirtDeclarative:
		return kubevirtsim.ModeDeclarative, kubevirtsim.V1_7_0, nil
	}
	mode, rest := kubevirtsim.Mode(""), name
	for _, m := range []kubevirtsim.Mode{kubevirtsim.ModeLegacy, kubevirtsim.ModeDeclarative} {
		if after, ok := strings.CutPrefix(name, string(m)+"-"); ok {
			mode, rest = m, after
		}
	}
	version, err := kubevirtsim.ParseVersion(rest)
	if err != nil {
		return "", "", fmt.Errorf("--kubevirt %q: %w (or %s, %s, %s)", name, err, KubeVirtLegacyV15, KubeVirtLegacyV17, KubeVirtDeclarative)
	}
	if mode == "" {
		mode = kubevirtsim.ModeDeclarative
		if version == kubevirtsim.V1_5_3 || version == kubevirtsim.V1_6_3 || version == kubevirtsim.V1_6_6 {
			mode = kubevirtsim.ModeLegacy
		}
	}
	if mode == kubevirtsim.ModeDeclarative && version == kubevirtsim.V1_5_3 {
		return "", "", fmt.Errorf("--kubevirt %q: KubeVirt 1.5 has no declarative hotplug", name)
	}
	return mode, version, nil
}

// capSysResource is the capability ext4's online resize (EXT4_IOC_RESIZE_FS)
// needs.
const capSysResource = 24

// startGrace is how long a pod may take to start before a run that ends
// without it having run counts it as never started: the stuck bound, which
// leaves room for Kubernetes' own recovery (the attach/detach controller
// waits up to 2 min for a VolumeAttachment it found still being deleted).
// A run shorter than that judges its workload by the other checks (no
// database moved, node calls failing for a missing tool).
func (c *Config) startGrace() time.Duration { return c.StuckBound }

// databasesUseXFS says whether the databases' claims are expanded on a
// machine where a mounted ext4 cannot grow.
func (c *Config) databasesUseXFS() bool {
	return c.ExpandEvery > 0 && !hasCapability(capSysResource)
}

// hasCapability reports whether capability bit c is in this process's
// effective set.
func hasCapability(c uint) bool {
	data, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return false
	}
	for _, l := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(l, "CapEff:"); ok {
			caps, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			return err == nil && caps&(1<<c) != 0
		}
	}
	return false
}

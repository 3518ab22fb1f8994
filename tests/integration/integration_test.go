// Package integration runs the controller service against a real
// kube-apiserver and the KubeVirt simulator, for every simulated KubeVirt
// version and hotplug mode, and against KubeVirt's own control plane
// (real-* flavors), under the concurrency the external-attacher produces.
// One flavor runs alone with -run 'TestController/<flavor>'.
package integration

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	kubevirtv1 "kubevirt.io/api/core/v1"
	"kubevirt.io/client-go/kubevirt"

	"github.com/harvester-csi/harvester-csi-driver/internal/csiattacher"
	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/realkubevirt"
	"github.com/harvester-csi/harvester-csi-driver/internal/simhost"
	"github.com/harvester-csi/harvester-csi-driver/internal/simlonghorn"
	"github.com/harvester-csi/harvester-csi-driver/internal/testenv"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
	kvbackend "github.com/harvester-csi/harvester-csi-driver/pkg/kubevirt"
	"github.com/harvester-csi/harvester-csi-driver/tests/framework"
)

// scale shrinks every simulated KubeVirt latency (an 8 s attachment-pod start
// becomes 0.4 s) so the suites run in minutes.
const scale = 0.05

// scaled is a simulated duration in wall time.
func scaled(d time.Duration) time.Duration { return time.Duration(float64(d) * scale) }

type flavor struct {
	name    string
	mode    kubevirtsim.Mode
	version kubevirtsim.Version
	backend string // what auto-detection must pick, or what --hotplug-backend forces
	forced  bool
}

// flavors cover every simulated KubeVirt version: the legacy gate on the
// releases Harvester 1.6 and 1.7 ship (v1.5.3, v1.6.3) and on v1.7.0, the
// declarative gate on the one Harvester 1.8 ships (v1.7.0) and on v1.8.2,
// and main with the subresource backend forced.
var flavors = []flavor{
	{"legacy-v1.5.3", kubevirtsim.ModeLegacy, kubevirtsim.V1_5_3, kvbackend.BackendSubresource, false},
	{"legacy-v1.6.3", kubevirtsim.ModeLegacy, kubevirtsim.V1_6_3, kvbackend.BackendSubresource, false},
	{"legacy-v1.7.0", kubevirtsim.ModeLegacy, kubevirtsim.V1_7_0, kvbackend.BackendSubresource, false},
	{"declarative-v1.7.0", kubevirtsim.ModeDeclarative, kubevirtsim.V1_7_0, kvbackend.BackendDeclarative, false},
	{"declarative-v1.8.2", kubevirtsim.ModeDeclarative, kubevirtsim.V1_8_2, kvbackend.BackendDeclarative, false},
	// The flag overrides detection: the VM subresources also serve a
	// declarative-only KubeVirt (they edit the VM spec there).
	{"declarative-main-forced-subresource", kubevirtsim.ModeDeclarative, kubevirtsim.VMain, kvbackend.BackendSubresource, true},
}

// backendFlag is what the controller is started with.
func (f flavor) backendFlag() string {
	if f.forced {
		return f.backend
	}
	return kvbackend.BackendAuto
}

func queueConfig() hotplug.Config { return queueConfigAt(scale) }

// queueConfigAt is the queue's configuration for a simulator running at
// scale s (MaxHold is simulated time).
func queueConfigAt(s float64) hotplug.Config {
	return hotplug.Config{
		BatchWindow: 100 * time.Millisecond,
		MaxHold:     time.Duration(float64(30*time.Second) * s),
		JoinWindow:  time.Duration(float64(hotplug.DefaultConfig().JoinWindow) * s),
		BackoffBase: 20 * time.Millisecond,
		BackoffMax:  500 * time.Millisecond,
		QPS:         100,
		Burst:       100,
	}
}

// realFlavors run the same scenarios on KubeVirt's own virt-controller and
// virt-api (internal/realkubevirt, built by hack/tools.sh) in the
// simulator's place: Harvester 1.8's declarative gate and the legacy gate
// on v1.7.0, and the declarative gate on v1.8.2. Only the node agents are
// stand-ins there, so simulated time does not apply and the scenarios that
// need the simulator's faults or request counters skip (simOnly). Each
// takes about three minutes of wall time on two cores, so only Harvester
// 1.8's (declarative on v1.7.0) runs by default; allRealEnv=all runs the
// others too.
var realFlavors = []realFlavor{
	{flavor: flavor{"real-declarative-v1.7.0", kubevirtsim.ModeDeclarative, "", kvbackend.BackendDeclarative, false}, tag: "v1.7.0", byDefault: true},
	{flavor: flavor{"real-legacy-v1.7.0", kubevirtsim.ModeLegacy, "", kvbackend.BackendSubresource, false}, tag: "v1.7.0"},
	{flavor: flavor{"real-declarative-v1.8.2", kubevirtsim.ModeDeclarative, "", kvbackend.BackendDeclarative, false}, tag: "v1.8.2"},
	// The host storage path under each attachment pod (simhost
	// Options.HostStorage: host nodes with real kubelets, scheduler,
	// attach/detach and csi-attacher over the Longhorn stand-in), which
	// needs root for the kubelets' mounts; hostStorageEnv=1 runs it.
	{flavor: flavor{"real-legacy-v1.7.0-host-storage", kubevirtsim.ModeLegacy, "", kvbackend.BackendSubresource, false}, tag: "v1.7.0", hostStorage: true},
}

// hostStorageFlavors run the same scenarios on the simulator with the
// host storage path under its attachment pods (kubevirtsim
// Options.Kubelets): Harvester 1.6's legacy KubeVirt v1.5.3, the lab's
// default profile. Like the real host-storage flavor they need root and
// hostStorageEnv=1.
var hostStorageFlavors = []flavor{
	{"legacy-v1.5.3-host-storage", kubevirtsim.ModeLegacy, kubevirtsim.V1_5_3, kvbackend.BackendSubresource, false},
}

// hostStorageEnv set to "1" runs the host-storage flavors.
const hostStorageEnv = "HCSI_HOST_STORAGE"

// hostStorageSkip says why the host-storage flavors do not run here, or "".
func hostStorageSkip() string {
	switch {
	case os.Getenv(hostStorageEnv) != "1":
		return fmt.Sprintf("the host storage path runs with %s=1", hostStorageEnv)
	case os.Geteuid() != 0:
		return "the host storage path's kubelets mount and map block volumes: needs root"
	}
	return ""
}

// allRealEnv set to "all" runs every real-control-plane flavor.
const allRealEnv = "HCSI_KUBEVIRT_REAL"

// realFlavor is a flavor on KubeVirt's real control plane of tag.
type realFlavor struct {
	flavor
	tag         string
	byDefault   bool
	hostStorage bool
}

// skip says why a real flavor does not run here, or "".
func (rf realFlavor) skip(bin string) string {
	if rf.hostStorage {
		if why := hostStorageSkip(); why != "" {
			return why
		}
	}
	switch {
	case !rf.hostStorage && !rf.byDefault && os.Getenv(allRealEnv) != "all":
		return fmt.Sprintf("one real-control-plane flavor runs by default; %s=all runs this one too", allRealEnv)
	case !realkubevirt.Built(bin, rf.tag):
		return fmt.Sprintf("KubeVirt %s binaries are not in %s: hack/tools.sh builds them", rf.tag, bin)
	}
	return ""
}

// suite is one host cluster flavor with a controller in front of it.
type suite struct {
	t    *testing.T
	f    flavor
	real string // the KubeVirt tag of the real control plane, or "" (simulator)
	host *framework.Host
	ctrl *framework.Controller
	kv   kubevirt.Interface // live reads, admin
	// hostStorage says the host runs the storage path under each
	// attachment pod (host nodes, Longhorn stand-in): every KubeVirt cycle
	// includes a host attach, several times the simulator's alone.
	hostStorage bool
}

// budget is how long a scenario that runs many KubeVirt cycles may take,
// d on the simulator alone.
func (s *suite) budget(d time.Duration) time.Duration {
	if s.hostStorage {
		return 4 * d
	}
	return d
}

func TestController(t *testing.T) {
	for _, f := range flavors {
		t.Run(f.name, func(t *testing.T) {
			// A flavor mostly waits on simulated time: two at once (the
			// default -parallel on two cores) keep the suite near five
			// minutes.
			t.Parallel()
			h := framework.StartHost(t, kubevirtsim.Options{Mode: f.mode, Version: f.version, Scale: scale, BindClasslessPVCs: true})
			runScenarios(t, &suite{t: t, f: f, host: h})
		})
	}
	for _, f := range hostStorageFlavors {
		t.Run(f.name, func(t *testing.T) {
			if why := hostStorageSkip(); why != "" {
				t.Skip(why)
			}
			t.Parallel()
			h := framework.StartHostWith(t, simhost.Options{
				Sim:         kubevirtsim.Options{Mode: f.mode, Version: f.version, Scale: scale, BindClasslessPVCs: true},
				HostStorage: true, Longhorn: simlonghorn.Options{Scale: scale}})
			runScenarios(t, &suite{t: t, f: f, host: h, hostStorage: true})
		})
	}
	bin, err := testenv.BinDir()
	if err != nil {
		t.Fatal(err)
	}
	for _, rf := range realFlavors {
		t.Run(rf.name, func(t *testing.T) {
			if why := rf.skip(bin); why != "" {
				t.Skip(why)
			}
			t.Parallel()
			h := framework.StartHostWith(t, simhost.Options{Real: rf.tag,
				Sim:         kubevirtsim.Options{Mode: rf.mode, BindClasslessPVCs: true},
				HostStorage: rf.hostStorage, Longhorn: simlonghorn.Options{Scale: scale}})
			runScenarios(t, &suite{t: t, f: rf.flavor, real: rf.tag, host: h, hostStorage: rf.hostStorage})
		})
	}
}

func runScenarios(t *testing.T, s *suite) {
	s.kv = kubevirt.NewForConfigOrDie(s.host.Env.Config)
	s.ctrl = s.host.StartController(t, framework.ControllerOptions{Backend: s.f.backendFlag(), Queue: queueConfig()})
	if got := s.ctrl.Queue.BackendName(); got != s.f.backend {
		t.Fatalf("backend %s, want %s (flag %s)", got, s.f.backend, s.f.backendFlag())
	}
	t.Run("ConcurrentPublishesToOneVM", s.concurrentPublishes)
	t.Run("StormOnThreeVMs", s.storm)
	t.Run("UnpublishBeforeTheBatchCancels", s.cancelBeforeBatch)
	t.Run("ExclusiveVolumeOnSecondVM", s.exclusive)
	t.Run("WebhookDeniedVolumeFailsAlone", s.webhookDenied)
	t.Run("DeletedVMReleasesItsVolumes", s.deletedVM)
	t.Run("StoppedVMReleasesOnUnpublish", s.stoppedVM)
	t.Run("TimedOutPublishThenUnpublish", s.timedOutPublishThenUnpublish)
	t.Run("RestartMidBatch", s.restartMidBatch)
	t.Run("FencingUnderInformerLagAndRestarts", s.fencingUnderLag)
	t.Run("TwoControllersAtOnce", s.twoControllers)
	t.Run("ReservationIsACompareAndSwap", s.reservationCAS)
	t.Run("CronJobReattachToTheSameVM", s.cronJobReattach)
	t.Run("ClaimDeletedWhileQueued", s.claimDeletedWhileQueued)
	t.Run("UnboundClaimBesideOthers", s.unboundClaim)
	t.Run("BurstsAPodStartApart", s.burstsAPodStartApart)
	t.Run("ReattachWhileDetaching", s.reattachWhileDetaching)
	t.Run("DeclarativeReadsTheSpecOnlyWhenItMoved", s.specReadOnlyWhenMoved)
	t.Run("LiveMigrationMidChurn", s.migrationMidChurn)
}

// simOnly skips a scenario on the real control plane: it needs one of the
// simulator's faults or its front proxy's request counters, which KubeVirt's
// own components do not have.
func (s *suite) simOnly(t *testing.T, what string) {
	t.Helper()
	if s.host.Sim == nil {
		t.Skipf("needs the simulator's %s; KubeVirt %s's real control plane has none", what, s.real)
	}
}

// resetStats zeroes the simulator's request counters; stats reads them, ok
// false on the real control plane (no counting proxy there).
func (s *suite) resetStats() {
	if s.host.Sim != nil {
		s.host.Sim.ResetStats()
	}
}

func (s *suite) stats() (kubevirtsim.Stats, bool) {
	if s.host.Sim == nil {
		return kubevirtsim.Stats{}, false
	}
	return s.host.Sim.Stats(), true
}

type csiClient = csi.ControllerClient

// attacher drives the driver by the external-attacher's rules
// (internal/csiattacher) and returns the first answer the attacher takes as
// final, the one a VolumeAttachment's status.attachError would show: the
// tests assert on it, so a refusal the driver should not give fails them
// instead of being retried away. The call timeout is longer than the
// attacher's 15 s at this scale (0.75 s) and the backoff shorter than its
// 5 min (15 s), so that a shared CI machine's pauses neither time calls out
// nor stretch the tests.
type attacher struct{ *csiattacher.Attacher }

func newAttacher(ctrl func() csi.ControllerClient) *attacher {
	cfg := csiattacher.Defaults().Scaled(scale)
	cfg.Workers, cfg.Timeout, cfg.RetryMax = 0, 3*time.Second, time.Second
	return &attacher{csiattacher.New(cfg, ctrl)}
}

func (a *attacher) do(ctx context.Context, call csiattacher.Call) error {
	return a.DoUntil(ctx, call, csiattacher.Final)
}

func (a *attacher) publish(ctx context.Context, vm, vol string) error {
	return a.do(ctx, csiattacher.PublishCall(publishReq(vm, vol)))
}

func (a *attacher) unpublish(ctx context.Context, vm, vol string) error {
	return a.do(ctx, csiattacher.UnpublishCall(vm, vol))
}

func publishReq(vm, vol string) *csi.ControllerPublishVolumeRequest {
	return &csi.ControllerPublishVolumeRequest{VolumeId: vol, NodeId: vm, VolumeCapability: &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}}
}

// leaked reports answers that must never reach the caller: KubeVirt's
// duplicate-request errors are the queue's business.
func (a *attacher) leaked() []string {
	var out []string
	for _, m := range a.Errors() {
		if strings.Contains(m, "already exists") || strings.Contains(m, "does not exist") || strings.Contains(m, "still being processed") {
			out = append(out, m)
		}
	}
	return out
}

func (s *suite) client() csi.ControllerClient { return s.ctrl.Client }

// attachedTo lists the VMs whose spec or VMI holds the volume, read live
// from the API server (the simulator's cache may lag the driver's).
func (s *suite) attachedTo(vol string, vms ...string) []string {
	s.t.Helper()
	ctx := context.Background()
	var out []string
	for _, vm := range vms {
		v, err := s.kv.KubevirtV1().VirtualMachines(s.host.Namespace).Get(ctx, vm, metav1.GetOptions{})
		if err == nil && v.Spec.Template != nil && kubevirtsim.HasVolume(v.Spec.Template.Spec.Volumes, vol) {
			out = append(out, vm)
			continue
		}
		vmi, err := s.kv.KubevirtV1().VirtualMachineInstances(s.host.Namespace).Get(ctx, vm, metav1.GetOptions{})
		if err == nil {
			if _, ok := kubevirtsim.FindVolumeStatus(vmi, vol); ok || kubevirtsim.HasVolume(vmi.Spec.Volumes, vol) {
				out = append(out, vm+"(vmi)")
			}
		}
	}
	return out
}

func (s *suite) requireReady(vm, vol string) {
	s.t.Helper()
	vmi, err := s.kv.KubevirtV1().VirtualMachineInstances(s.host.Namespace).Get(context.Background(), vm, metav1.GetOptions{})
	if err != nil {
		s.t.Fatal(err)
	}
	e, ok := kubevirtsim.FindVolumeStatus(vmi, vol)
	if !ok || e.Phase != kubevirtv1.VolumeReady || e.Target == "" {
		s.t.Errorf("publish of %s to %s answered OK but the VMI shows %+v", vol, vm, e)
	}
}

// dumpOnFailure logs the VMs' and VMIs' hotplug state when t fails.
func (s *suite) dumpOnFailure(t *testing.T, vms ...string) {
	t.Cleanup(func() {
		if !t.Failed() {
			return
		}
		ctx := context.Background()
		for _, vm := range vms {
			v, err := s.kv.KubevirtV1().VirtualMachines(s.host.Namespace).Get(ctx, vm, metav1.GetOptions{})
			if err == nil {
				var names []string
				for _, x := range v.Spec.Template.Spec.Volumes {
					names = append(names, x.Name)
				}
				t.Logf("VM %s: volumes %v, requests %d, conditions %+v", vm, names, len(v.Status.VolumeRequests), v.Status.Conditions)
			} else {
				t.Logf("VM %s: %v", vm, err)
			}
			vmi, err := s.kv.KubevirtV1().VirtualMachineInstances(s.host.Namespace).Get(ctx, vm, metav1.GetOptions{})
			if err != nil {
				t.Logf("VMI %s: %v", vm, err)
				continue
			}
			var names []string
			for _, x := range vmi.Spec.Volumes {
				names = append(names, x.Name)
			}
			t.Logf("VMI %s: phase %s, volumes %v", vm, vmi.Status.Phase, names)
			for _, st := range vmi.Status.VolumeStatus {
				t.Logf("  %s: %s %s/%s target=%q pod=%v", st.Name, st.Phase, st.Reason, st.Message, st.Target, st.HotplugVolume)
			}
		}
	})
}

// anyWritten reports whether the VM's spec or legacy request list names one
// of the volumes, read live.
func (s *suite) anyWritten(vm string, vols []string) bool {
	v, err := s.kv.KubevirtV1().VirtualMachines(s.host.Namespace).Get(context.Background(), vm, metav1.GetOptions{})
	if err != nil {
		return false
	}
	for _, vol := range vols {
		if kubevirtsim.HasVolume(v.Spec.Template.Spec.Volumes, vol) {
			return true
		}
		for _, r := range v.Status.VolumeRequests {
			if r.AddVolumeOptions != nil && r.AddVolumeOptions.Name == vol {
				return true
			}
		}
	}
	return false
}

package integration

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"kubevirt.io/client-go/kubevirt"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/realkubevirt"
	"github.com/harvester-csi/harvester-csi-driver/internal/simharvester"
	"github.com/harvester-csi/harvester-csi-driver/internal/simhost"
	"github.com/harvester-csi/harvester-csi-driver/internal/testenv"
	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
	"github.com/harvester-csi/harvester-csi-driver/tests/framework"
)

// webhookCacheLag is how far behind the VM writes Harvester's validator
// judges in these scenarios: longer than an unpublish and the next publish
// take, so that the publish meets the old VM in its cache.
const webhookCacheLag = 5 * time.Second

// webhookFlavors are hosts that serve Harvester's webhooks: Harvester 1.6
// (legacy hotplug on the simulated KubeVirt 1.5, the 1.6 rules) and 1.8
// (declarative on the simulated and on KubeVirt's real v1.7.0, the 1.8
// rules).
var webhookFlavors = []struct {
	flavor
	real     string
	webhooks simharvester.Release
}{
	{flavors[0], "", simharvester.V1_6},
	{flavors[3], "", simharvester.V1_8},
	{realFlavors[0].flavor, realFlavors[0].tag, simharvester.V1_8},
}

// TestUnderHarvesterWebhooks runs the scenarios that meet Harvester's own
// admission webhooks (internal/simharvester), whose validator lags the VM
// writes by webhookCacheLag.
func TestUnderHarvesterWebhooks(t *testing.T) {
	bin, err := testenv.BinDir()
	if err != nil {
		t.Fatal(err)
	}
	for _, wf := range webhookFlavors {
		t.Run(wf.name, func(t *testing.T) {
			if wf.real != "" && !realkubevirt.Built(bin, wf.real) {
				t.Skipf("KubeVirt %s binaries are not in %s: hack/tools.sh builds them", wf.real, bin)
			}
			t.Parallel()
			o := simhost.Options{Real: wf.real, Webhooks: wf.webhooks, WebhookCacheLag: webhookCacheLag,
				Sim: kubevirtsim.Options{Mode: wf.mode, Version: wf.version, Scale: scale, BindClasslessPVCs: true}}
			if wf.real != "" {
				o.Sim = kubevirtsim.Options{Mode: wf.mode, BindClasslessPVCs: true}
			}
			s := &suite{t: t, f: wf.flavor, real: wf.real, host: framework.StartHostWith(t, o)}
			s.kv = kubevirt.NewForConfigOrDie(s.host.Env.Config)
			s.ctrl = s.host.StartController(t, framework.ControllerOptions{Backend: s.f.backendFlag(), Queue: queueConfig()})
			t.Run("RWOMoveUnderTheValidator", s.rwoMoveUnderValidator)
			t.Run("WebhookOutageDuringChurn", s.webhookOutageDuringChurn)
		})
	}
}

// rwoMoveUnderValidator: an RWO volume moves back and forth between two VMs,
// each publish right after the unpublish from the other VM, while
// Harvester's validator still sees the volume on the old VM and refuses the
// write ("already used by"). The publish waits and lands once the validator
// catches up: no final answer, never two holders.
func (s *suite) rwoMoveUnderValidator(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	vms := []string{"wm-a", "wm-b"}
	vol, a := s.publishedOn(ctx, t, "wm", vms...)
	for round := range 4 {
		from, to := vms[round%2], vms[(round+1)%2]
		testwait.Until(ctx, t, "Harvester's validator to see the volume on "+from, func() (bool, string) {
			h := s.host.Harvester.Holders(s.host.Namespace, vol)
			return slices.Equal(h, []string{from}), fmt.Sprint(h)
		})
		if err := a.unpublish(ctx, from, vol); err != nil {
			t.Fatalf("round %d: unpublish from %s: %v", round, from, err)
		}
		if err := a.publish(ctx, to, vol); err != nil {
			t.Fatalf("round %d: publish to %s right after the unpublish from %s: %v", round, to, from, err)
		}
		if got := s.attachedTo(vol, vms...); len(got) != 1 || got[0] != to {
			t.Fatalf("round %d: published to %s but held by %v", round, to, got)
		}
		s.requireReady(to, vol)
	}
	if err := a.unpublish(ctx, vms[0], vol); err != nil {
		t.Fatal(err)
	}
	t.Logf("%s: answers %v", s.f.name, a.Answers())
}

// webhookOutageDuringChurn: volumes move between three VMs while Harvester's
// webhook service goes away twice; every VM write fails meanwhile. Every
// call ends answered OK, no volume is ever on two VMs, and nothing is left
// attached at the end.
func (s *suite) webhookOutageDuringChurn(t *testing.T) {
	vms := []string{"wo-a", "wo-b", "wo-c"}
	vols := s.scene(t, "wo", 6, vms...)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	churnCtx, stopOutages := context.WithCancel(ctx)
	outages := make(chan error, 1)
	go func() { outages <- s.outages(churnCtx, 2) }()
	a := newAttacher(s.client)
	eachAtOnce(vols, func(i int, vol string) {
		for round := range 3 {
			vm := vms[(i+round)%len(vms)]
			if err := a.publish(ctx, vm, vol); err != nil {
				t.Errorf("round %d: publish %s to %s: %v", round, vol, vm, err)
				return
			}
			if got := s.attachedTo(vol, vms...); len(got) != 1 || got[0] != vm {
				t.Errorf("round %d: %s published to %s but held by %v", round, vol, vm, got)
			}
			if err := a.unpublish(ctx, vm, vol); err != nil {
				t.Errorf("round %d: unpublish %s from %s: %v", round, vol, vm, err)
				return
			}
		}
	})
	stopOutages()
	if err := <-outages; err != nil {
		t.Fatal(err)
	}
	t.Logf("%s: answers %v", s.f.name, a.Answers())
	if n := a.Answers()[codes.FailedPrecondition]; n > 0 {
		t.Errorf("%d FailedPrecondition answers for volumes never held elsewhere: %v", n, a.Errors())
	}
	for _, vol := range vols {
		if got := s.attachedTo(vol, vms...); len(got) != 0 {
			t.Errorf("%s still held by %v after the churn", vol, got)
		}
	}
}

// outages takes the webhook service away n times while ctx lasts, each
// time until a VM write has failed calling it, then brings it back.
func (s *suite) outages(ctx context.Context, n int) error {
	w := s.host.Harvester
	for i := range n {
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(scaled(20 * time.Second)):
		}
		w.Down()
		err := testwait.Poll(ctx, "a VM write failing during the outage", func() (bool, string, error) {
			err := s.touchVM(ctx, "wo-a")
			return err != nil, fmt.Sprint(err), nil
		})
		// The service stays away a while, as a webhook pod restarting
		// does: the driver's writes meet it meanwhile.
		select {
		case <-ctx.Done():
		case <-time.After(scaled(40 * time.Second)):
		}
		if upErr := w.Up(); upErr != nil {
			return upErr
		}
		if err != nil && ctx.Err() == nil {
			return fmt.Errorf("outage %d: %w", i, err)
		}
	}
	return nil
}

// touchVM writes a label on the VM: a write the validator sees.
func (s *suite) touchVM(ctx context.Context, vm string) error {
	patch := fmt.Appendf(nil, `{"metadata":{"labels":{"touched":"%d"}}}`, time.Now().UnixNano())
	_, err := s.kv.KubevirtV1().VirtualMachines(s.host.Namespace).Patch(ctx, vm, types.MergePatchType, patch, metav1.PatchOptions{})
	return err
}

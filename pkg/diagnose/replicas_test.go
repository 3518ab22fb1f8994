package diagnose

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"testing"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/utils/ptr"

	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
)

func controllerPod(name, ip string) *corev1.Pod {
	return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "kube-system",
		Labels: map[string]string{"component": "csi-controllers", "app.kubernetes.io/name": "harvester-csi-driver"}},
		Spec: corev1.PodSpec{Containers: []corev1.Container{{Name: "harvester-csi-driver",
			Ports: []corev1.ContainerPort{{Name: "healthz", ContainerPort: 9808}, {Name: MetricsPortName, ContainerPort: 9809}}}}},
		Status: corev1.PodStatus{Phase: corev1.PodRunning, PodIP: ip}}
}

func attacherLease(holder string) *coordinationv1.Lease {
	return &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: AttacherLeaseName(drv), Namespace: "kube-system"},
		Spec: coordinationv1.LeaseSpec{HolderIdentity: ptr.To(holder)}}
}

// fakeReplicas answers each replica's state by URL; a missing URL does not
// answer.
func fakeReplicas(states map[string][]hotplug.VMState) stateReader {
	return func(_ context.Context, base string) ([]hotplug.VMState, error) {
		st, ok := states[base]
		if !ok {
			return nil, errors.New("connection refused")
		}
		return st, nil
	}
}

func vmsOf(states []hotplug.VMState) []string {
	var out []string
	for _, s := range states {
		out = append(out, s.VM)
	}
	slices.Sort(out)
	return out
}

func TestAttacherLeaseName(t *testing.T) {
	if got, want := AttacherLeaseName("driver.harvesterhci.io"), "external-attacher-leader-driver-harvesterhci-io"; got != want {
		t.Errorf("AttacherLeaseName = %q, want %q", got, want)
	}
	if got := AttacherLeaseName("x/"); got != "external-attacher-leader-x-X" {
		t.Errorf("a name ending in a replaced character: %q", got)
	}
}

// TestTheAttacherLeadersQueueIsRead: of three replicas, the one holding the
// attacher's Lease is read (the others are idle); without a Lease, or when
// its holder does not answer, every replica that answers is merged, and the
// notes say why.
func TestTheAttacherLeadersQueueIsRead(t *testing.T) {
	pods := []runtime.Object{controllerPod("ctrl-a", "10.0.0.1"), controllerPod("ctrl-b", "10.0.0.2"), controllerPod("ctrl-c", "10.0.0.3")}
	states := map[string][]hotplug.VMState{
		"http://10.0.0.1:9809": {},
		"http://10.0.0.2:9809": {{VM: "vm-busy"}},
		"http://10.0.0.3:9809": {{VM: "vm-monitor"}},
	}
	ctx := context.Background()
	r := Replicas{Namespace: "kube-system", Selector: DefaultControllerSelector}

	guest := fake.NewClientset(append(pods, attacherLease("ctrl-b"))...)
	st, src, notes := replicaQueue(ctx, guest, r, drv, fakeReplicas(states))
	if !slices.Equal(vmsOf(st), []string{"vm-busy"}) || !strings.Contains(src, "ctrl-b") || len(notes) != 0 {
		t.Errorf("with the Lease held by ctrl-b: states %v from %q, notes %v", vmsOf(st), src, notes)
	}

	guest = fake.NewClientset(pods...)
	st, src, notes = replicaQueue(ctx, guest, r, drv, fakeReplicas(states))
	if !slices.Equal(vmsOf(st), []string{"vm-busy", "vm-monitor"}) || src != "replicas ctrl-a, ctrl-b, ctrl-c merged" || len(notes) != 1 {
		t.Errorf("without the Lease: states %v from %q, notes %v", vmsOf(st), src, notes)
	}

	delete(states, "http://10.0.0.2:9809")
	guest = fake.NewClientset(append(pods, attacherLease("ctrl-b"))...)
	st, src, notes = replicaQueue(ctx, guest, r, drv, fakeReplicas(states))
	if !slices.Equal(vmsOf(st), []string{"vm-monitor"}) || src != "replicas ctrl-a, ctrl-c merged" || !strings.Contains(strings.Join(notes, "\n"), "connection refused") {
		t.Errorf("with the holder not answering: states %v from %q, notes %v", vmsOf(st), src, notes)
	}

	st, src, notes = replicaQueue(ctx, fake.NewClientset(), r, drv, fakeReplicas(states))
	if st != nil || src != "" || !strings.Contains(notes[len(notes)-1], "no controller replica") {
		t.Errorf("without any replica: states %v from %q, notes %v", vmsOf(st), src, notes)
	}
}

func TestAPodWithoutMetricsPortIsNotGuessed(t *testing.T) {
	p := controllerPod("ctrl-a", "10.0.0.1")
	p.Spec.Containers[0].Ports = p.Spec.Containers[0].Ports[:1]
	if _, err := podStateURL(p); err == nil || !strings.Contains(err.Error(), "metrics.enabled=false") {
		t.Errorf("a pod without a metrics port: %v", err)
	}
}

// TestJSONReportKeepsTheExitCode: -o json prints every finding with its
// severity and gives the same exit code as the text report.
func TestJSONReportKeepsTheExitCode(t *testing.T) {
	in := Input{Driver: drv, Namespace: "ns", QueueSource: "replica ctrl-b", Notes: []string{"a note"}}
	findings := []Finding{{Kind: GhostAttachment, Volume: "pvc-1", VM: "vm-a", Node: "node-a", Detail: "held"},
		{Kind: InUseNotInVM, Volume: "pvc-2", VM: "vm-a", Node: "node-a", Info: true, Detail: "listed"}}
	var b strings.Builder
	code := ReportJSON(&b, in, findings)
	var got JSONReport
	if err := json.Unmarshal([]byte(b.String()), &got); err != nil {
		t.Fatalf("not one JSON object: %v\n%s", err, b.String())
	}
	want := []JSONFinding{{Kind: GhostAttachment, Severity: SeverityDisagreement, Volume: "pvc-1", VM: "vm-a", Node: "node-a", Message: "held"},
		{Kind: InUseNotInVM, Severity: SeverityInfo, Volume: "pvc-2", VM: "vm-a", Node: "node-a", Message: "listed"}}
	if !slices.Equal(got.Findings, want) || got.Disagreements != 1 || got.ExitCode != ExitFindings || got.QueueSource != "replica ctrl-b" || !slices.Equal(got.Notes, in.Notes) {
		t.Errorf("JSON report %+v", got)
	}
	if textCode := Report(&strings.Builder{}, in, findings); code != textCode || code != ExitFindings {
		t.Errorf("exit code %d in JSON, %d in text, want %d", code, textCode, ExitFindings)
	}
	b.Reset()
	if code := ReportJSON(&b, in, findings[1:]); code != ExitClean || !strings.Contains(b.String(), `"findings": [`) {
		t.Errorf("informational only: exit code %d\n%s", code, b.String())
	}
}

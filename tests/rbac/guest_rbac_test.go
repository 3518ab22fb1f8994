// Package rbac checks that the driver's own guest-cluster API calls fit the
// permissions list the chart is tested against
// (charts/harvester-csi-driver/ci/required-guest-permissions.yaml): the calls
// run on a real kube-apiserver as a user that holds exactly those rules, so
// a call the list (and so the chart) lacks fails here with 403.
package rbac

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	authorizationv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	storagev1 "k8s.io/api/storage/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"sigs.k8s.io/yaml"

	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
	"github.com/harvester-csi/harvester-csi-driver/pkg/driver"
	"github.com/harvester-csi/harvester-csi-driver/pkg/guest"
	"github.com/harvester-csi/harvester-csi-driver/pkg/hotplug"
	"github.com/harvester-csi/harvester-csi-driver/pkg/node/sweeper"
	"github.com/harvester-csi/harvester-csi-driver/tests/framework"
)

type permission struct {
	ServiceAccount string   `json:"serviceAccount"`
	Scope          string   `json:"scope"`
	APIGroup       string   `json:"apiGroup"`
	Resource       string   `json:"resource"`
	Verbs          []string `json:"verbs"`
	UsedBy         []string `json:"usedBy"`
}

// rulesFor returns the listed rules of a service account that the driver
// binary itself uses (sidecars' needs are their releases' business).
func rulesFor(t *testing.T, sa string) []rbacv1.PolicyRule {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(repoRoot(t), "charts", "harvester-csi-driver", "ci", "required-guest-permissions.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var list struct {
		Permissions []permission `json:"permissions"`
	}
	if err := yaml.UnmarshalStrict(raw, &list); err != nil {
		t.Fatal(err)
	}
	var rules []rbacv1.PolicyRule
	for _, p := range list.Permissions {
		if p.ServiceAccount != sa || !strings.HasPrefix(strings.Join(p.UsedBy, ","), "harvester-csi-driver") {
			continue
		}
		rules = append(rules, rbacv1.PolicyRule{APIGroups: []string{p.APIGroup}, Resources: []string{p.Resource}, Verbs: p.Verbs})
	}
	if len(rules) == 0 {
		t.Fatalf("no rules listed for the driver under service account %q", sa)
	}
	return rules
}

// asUser binds rules to a user and returns a client impersonating it.
func asUser(t *testing.T, ctx context.Context, admin *rest.Config, user string, rules []rbacv1.PolicyRule) kubernetes.Interface {
	t.Helper()
	kube := kubernetes.NewForConfigOrDie(admin)
	role := &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: user}, Rules: rules}
	if _, err := kube.RbacV1().ClusterRoles().Create(ctx, role, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	binding := &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: user},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: user},
		Subjects:   []rbacv1.Subject{{Kind: rbacv1.UserKind, APIGroup: rbacv1.GroupName, Name: user}},
	}
	if _, err := kube.RbacV1().ClusterRoleBindings().Create(ctx, binding, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	waitAuthorized(t, ctx, kube, user, rules)
	cfg := rest.CopyConfig(admin)
	cfg.Impersonate = rest.ImpersonationConfig{UserName: user}
	return kubernetes.NewForConfigOrDie(cfg)
}

// waitAuthorized waits until the API server's authorizer grants user each
// rule: it learns of new bindings through its own informers, so a call made
// right after the binding was written may still be refused, and a test that
// then finds the call's effect missing would blame the rules.
func waitAuthorized(t *testing.T, ctx context.Context, kube kubernetes.Interface, user string, rules []rbacv1.PolicyRule) {
	t.Helper()
	for _, r := range rules {
		if len(r.Verbs) == 0 || len(r.Resources) == 0 || len(r.APIGroups) == 0 {
			continue
		}
		attrs := &authorizationv1.ResourceAttributes{Verb: r.Verbs[0], Group: r.APIGroups[0], Resource: r.Resources[0]}
		testwait.Until(ctx, t, fmt.Sprintf("the authorizer to grant %s %s", user, attrs), func() (bool, string) {
			sar := &authorizationv1.SubjectAccessReview{Spec: authorizationv1.SubjectAccessReviewSpec{User: user, ResourceAttributes: attrs}}
			got, err := kube.AuthorizationV1().SubjectAccessReviews().Create(ctx, sar, metav1.CreateOptions{})
			if err != nil {
				return false, err.Error()
			}
			return got.Status.Allowed, got.Status.Reason
		})
	}
}

func TestNodePluginGuestCallsFitTheListedPermissions(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	g := framework.StartGuest(t)
	env, admin := g.Env, g.Kube
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "guest-node-1"}}
	if _, err := admin.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: "pvc-with-pv"},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:               corev1.ResourceList{corev1.ResourceStorage: *resourceQuantity("1Gi")},
			AccessModes:            []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: driver.Name, VolumeHandle: "pvc-with-pv"}},
		},
	}
	if _, err := admin.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	client := asUser(t, ctx, env.Config, "system:serviceaccount:kube-system:harvester-csi-driver-node", rulesFor(t, "node"))
	events := sweeper.NewKubeEvents(ctx, client, node.Name, driver.Name)
	// A volume with a guest PV gets the Event on the PV, one without on the node.
	events.Event(ctx, "pvc-with-pv", corev1.EventTypeWarning, "StaleStagingMount", "swept for the test")
	events.Event(ctx, "pvc-without-pv", corev1.EventTypeWarning, "StaleStagingMount", "swept for the test")

	want := map[string]bool{"PersistentVolume/pvc-with-pv": false, "Node/guest-node-1": false}
	wctx, wcancel := context.WithTimeout(ctx, 30*time.Second)
	defer wcancel()
	testwait.Until(wctx, t, "events recorded with only the listed permissions (a missing one means the driver needs a permission the list and chart lack)", func() (bool, string) {
		list, err := admin.CoreV1().Events("").List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, err.Error()
		}
		for _, e := range list.Items {
			if e.Reason == "StaleStagingMount" {
				want[e.InvolvedObject.Kind+"/"+e.InvolvedObject.Name] = true
			}
		}
		return want["PersistentVolume/pvc-with-pv"] && want["Node/guest-node-1"], fmt.Sprint(want)
	})
}

func resourceQuantity(s string) *resource.Quantity {
	q := resource.MustParse(s)
	return &q
}

// TestControllerGuestCallsFitTheListedPermissions runs the controller's
// guest side (the caches of the detach guard, its forced-detach Event, the
// node monitor's election, taint and Events) as a user holding only the
// listed rules of the driver under the controller's service account.
func TestControllerGuestCallsFitTheListedPermissions(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	g := framework.StartGuest(t)
	env, admin := g.Env, g.Kube
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "rke2-worker-1"}}
	if _, err := admin.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	node.Status = corev1.NodeStatus{
		Conditions:   []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionUnknown}},
		VolumesInUse: []corev1.UniqueVolumeName{guest.UniqueVolumeName(driver.Name, "pvc-a")},
	}
	if _, err := admin.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.StorageV1().CSINodes().Create(ctx, &storagev1.CSINode{
		ObjectMeta: metav1.ObjectMeta{Name: node.Name},
		Spec:       storagev1.CSINodeSpec{Drivers: []storagev1.CSINodeDriver{{Name: driver.Name, NodeID: "vm-1"}}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	client := asUser(t, ctx, env.Config, "system:serviceaccount:kube-system:harvester-csi-driver", rulesFor(t, "controller"))
	nodes, err := guest.NewNodes(client, driver.Name, 0)
	if err != nil {
		t.Fatal(err)
	}
	events := guest.NewRecorder(client, driver.Name, "")
	defer events.Stop()
	vms := stoppedVM{}
	monitor, err := guest.NewMonitor(guest.MonitorConfig{LeaseDuration: 4 * time.Second, RenewDeadline: 3 * time.Second, RetryPeriod: 200 * time.Millisecond},
		client, nodes, vms, events)
	if err != nil {
		t.Fatal(err)
	}
	nodes.Start(ctx.Done())
	if !cache.WaitForCacheSync(ctx.Done(), nodes.HasSynced) {
		t.Fatal("the guest caches did not sync with the listed permissions (list/watch of nodes or csinodes refused)")
	}
	// A zero timeout forces at once: the Event needs "create" on events.
	if err := guest.NewGuard(nodes, events, 0).Allow(ctx, "vm-1", "pvc-a"); err != nil {
		t.Fatal(err)
	}
	go func() { _ = monitor.Run(ctx) }()
	// What a publish waits for goes on its VolumeAttachment, twice: the
	// repeat is aggregated into the same Event (patch).
	vaName := guest.AttachmentName("pvc-a", driver.Name, node.Name)
	pv := "pv-a"
	if _, err := admin.StorageV1().VolumeAttachments().Create(ctx, &storagev1.VolumeAttachment{ObjectMeta: metav1.ObjectMeta{Name: vaName},
		Spec: storagev1.VolumeAttachmentSpec{Attacher: driver.Name, NodeName: node.Name, Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: &pv}}},
		metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	vaEvents := guest.NewAttachmentEvents(client, nodes, driver.Name, events)
	for range 2 {
		vaEvents.Record(ctx, "pvc-a", "vm-1", corev1.EventTypeNormal, "HotplugWaiting", "waiting for KubeVirt to plug the volume")
	}

	want := map[string]bool{"VolumeDetachForced": false, "NodeOutOfService": false, "HotplugWaiting": false}
	done, cancelDone := context.WithTimeout(ctx, time.Minute)
	defer cancelDone()
	// A missing event or taint means the driver needs a permission the list
	// and chart lack.
	testwait.Until(done, t, "the taint, the events and the lease with only the listed permissions", func() (bool, string) {
		n, err := admin.CoreV1().Nodes().Get(ctx, node.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		list, err := admin.CoreV1().Events(metav1.NamespaceDefault).List(ctx, metav1.ListOptions{})
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range list.Items {
			if _, ok := want[e.Reason]; ok && (e.Reason != "HotplugWaiting" || e.InvolvedObject.Kind == "VolumeAttachment" && e.InvolvedObject.Name == vaName && e.Count == 2) {
				want[e.Reason] = true
			}
		}
		return guest.OutOfService(n) && want["VolumeDetachForced"] && want["NodeOutOfService"] && want["HotplugWaiting"] && monitor.Leading(),
			fmt.Sprintf("tainted %v, leading %v, events %v", guest.OutOfService(n), monitor.Leading(), want)
	})
}

// stoppedVM is a host where every VM exists and is stopped.
type stoppedVM struct{}

func (stoppedVM) Ready() bool { return true }

func (stoppedVM) View(string) hotplug.VMView { return hotplug.VMView{Exists: true} }

func (stoppedVM) GuestStopped(context.Context, string) (bool, string, error) {
	return true, "no VMI and no virt-launcher pod", nil
}

func (stoppedVM) DetachBefore(context.Context, string, string, time.Time) error { return nil }
